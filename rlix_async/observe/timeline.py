"""Device ownership from a scheduling journal, and ``rlix-async timeline``: a
per-device Gantt chart of it.

One colour per pipeline, one hatch per stage (rollout plain). Works on the
coordinator's journal and on the simulator's (same events). :class:`Ownership`
is also what ``rlix-async trace`` (observe/trace.py) draws its device tracks
from; matplotlib is imported only to draw, so the trace never pays for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from rlix_async.control.journal import (
    Event,
    Expanded,
    Granted,
    Registered,
    Released,
    Shrunk,
    Unregistered,
    read_journal,
)
from rlix_async.protocols.topology import ClusterSpec

GENERATION = "GENERATION"  # the stage of a rollout rank (Priority.GENERATION's name)
HATCH = {
    "GENERATION": "",
    "INITIALIZATION": "..",
    "ACTOR_TRAINING": "//",
    "CRITIC_TRAINING": "\\\\",
    "OLD_LOG_PROBS": "xx",
    "REF_LOG_PROBS": "++",
    "VALUE_COMPUTE": "oo",
}


class Span(NamedTuple):
    """One stretch of one device held by one pipeline's stage (or rollout rank)."""

    device: int
    pipeline: str
    cluster: str
    stage: str  # the priority name; GENERATION for a rollout rank
    rank: int | None  # the rollout rank; None for a granted stage
    start: float
    end: float
    until_end: bool = False  # still held when the journal ends


class _Held(NamedTuple):
    pipeline: str
    cluster: str
    stage: str
    rank: int | None
    start: float


class Ownership:
    """Who holds each device, rebuilt event by event from a journal (coordinator's or
    simulator's). Each device has at most one holder at a time, so the spans of one
    device never overlap. Events it does not draw (progress, snapshots, fences) pass."""

    def __init__(self) -> None:
        self.held: dict[int, _Held] = {}
        self.spans: list[Span] = []
        # devices each pipeline holds now, [stages, rollout], and the pipelines whose
        # count changed since the caller last emptied ``changed`` (the trace's counters)
        self.counts: dict[str, list[int]] = {}
        self.changed: set[str] = set()
        self._grants: dict[tuple[str, str], list[int]] = {}
        self._specs: dict[tuple[str, str], ClusterSpec] = {}

    def apply(self, e: Event) -> None:
        pid, t = e.pipeline, e.t
        match e:
            case Registered():
                for cluster, spec in e.clusters.items():
                    self._specs[(pid, cluster)] = spec
            case Granted():
                self._grants[(pid, e.cluster)] = list(e.devices)
                for d in e.devices:
                    h = self.held.get(d)
                    holder = None if h is None else (h.pipeline, h.cluster, h.stage)
                    if holder != (pid, e.cluster, e.priority):  # a repeated grant goes on
                        self._close(d, t)
                        self._open(d, _Held(pid, e.cluster, e.priority, None, t))
            case Released():
                for d in self._grants.pop((pid, e.cluster), []):
                    self._close_if(d, t, pid, e.cluster)
            case Expanded():
                for rank, devices in self._by_rank(pid, e.cluster, e.ranks, e.devices):
                    for d in devices:
                        self._close(d, t)
                        self._open(d, _Held(pid, e.cluster, GENERATION, rank, t))
            case Shrunk():
                for d in e.devices:
                    self._close_if(d, t, pid, e.cluster, GENERATION)
            case Unregistered():
                for d in [d for d, h in self.held.items() if h.pipeline == pid]:
                    self._close(d, t)
                for key in [k for k in self._grants if k[0] == pid]:
                    del self._grants[key]
            case _:
                pass

    def rank_devices(self, pipeline: str, rank: int) -> list[int]:
        """The devices a rollout rank holds now (empty when asleep or unknown)."""
        return sorted(
            d
            for d, h in self.held.items()
            if h.pipeline == pipeline and h.rank == rank and h.stage == GENERATION
        )

    def finish(self, t_end: float) -> list[Span]:
        """Close what is still held at ``t_end``; every span, by device then start."""
        for d in list(self.held):
            self._close(d, t_end, until_end=True)
        return sorted(self.spans, key=lambda s: (s.device, s.start, s.end))

    def _by_rank(
        self, pid: str, cluster: str, ranks: Sequence[int], devices: Sequence[int]
    ) -> list[tuple[int | None, list[int]]]:
        """Each rank's devices: from its registered topology, else an even split of the
        event's devices (ranks in order, ``tp`` devices each), else no rank."""
        spec = self._specs.get((pid, cluster))
        if spec is not None:
            return [(r, list(spec.bundle(r))) for r in ranks]
        if ranks and len(devices) % len(ranks) == 0:
            tp = len(devices) // len(ranks)
            return [(r, list(devices[i * tp : (i + 1) * tp])) for i, r in enumerate(ranks)]
        return [(None, list(devices))]

    def _close_if(self, d: int, t: float, pid: str, cluster: str, stage: str | None = None) -> None:
        """Close ``d`` only if this holder still has it (another may have taken it since)."""
        h = self.held.get(d)
        if h is None or (h.pipeline, h.cluster) != (pid, cluster):
            return
        if stage is None or h.stage == stage:
            self._close(d, t)

    def _open(self, d: int, h: _Held) -> None:
        self.held[d] = h
        self.counts.setdefault(h.pipeline, [0, 0])[h.stage == GENERATION] += 1
        self.changed.add(h.pipeline)

    def _close(self, d: int, t: float, *, until_end: bool = False) -> None:
        h = self.held.pop(d, None)
        if h is not None:
            self.counts[h.pipeline][h.stage == GENERATION] -= 1
            self.changed.add(h.pipeline)
            end = max(t, h.start)  # a clock stepped back never makes a negative span
            self.spans.append(
                Span(d, h.pipeline, h.cluster, h.stage, h.rank, h.start, end, until_end)
            )


def spans(events: Iterable[Event]) -> list[Span]:
    """Every stretch a device was held, by device then start."""
    own = Ownership()
    t_end = 0.0
    for e in events:
        own.apply(e)
        t_end = max(t_end, e.t)
    return own.finish(t_end)


def pipeline_colours(pipelines: list[str]) -> dict[str, tuple[float, float, float, float]]:
    """One colour per pipeline id, by sorted id: every picture of a run (timeline, reward,
    eval curves) gives a pipeline the same colour, whatever order it lists them in."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {p: cmap(i % 10) for i, p in enumerate(sorted(set(pipelines)))}


def draw_timeline(journal: str | Path, output: str | Path) -> Path:
    drawn = spans(read_journal(journal))
    if not drawn:
        raise ValueError(f"{journal}: no grant or expand events to draw")
    import matplotlib  # a second to import: only once there is something to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(s.start for s in drawn)
    pipelines = sorted({s.pipeline for s in drawn})
    colour = pipeline_colours(pipelines)
    devices = sorted({s.device for s in drawn})
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(devices) + 1.8))
    for s in drawn:
        ax.barh(
            s.device,
            s.end - s.start,
            left=s.start - t0,
            height=0.8,
            color=colour[s.pipeline],
            edgecolor="black",
            linewidth=0.3,
            hatch=HATCH.get(s.stage, ""),
        )
    ax.set_yticks(devices, [f"dev {d}" for d in devices])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"{Path(journal).name}: device ownership")
    stages = sorted(
        {s.stage for s in drawn}, key=lambda s: list(HATCH).index(s) if s in HATCH else 99
    )
    handles = [Patch(facecolor=colour[p], label=p) for p in pipelines]
    handles += [
        Patch(facecolor="white", edgecolor="black", hatch=HATCH.get(s, ""), label=s.lower())
        for s in stages
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    out = Path(output)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

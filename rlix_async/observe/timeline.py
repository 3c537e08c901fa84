"""``rlix-async timeline``: a per-device Gantt chart of a scheduling journal.

One colour per pipeline, one hatch per stage (rollout plain). Works on the
coordinator's journal and on the simulator's (same events).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from rlix_async.control.journal import (
    Event,
    Expanded,
    Granted,
    Released,
    Shrunk,
    Unregistered,
    read_journal,
)

HATCH = {
    "GENERATION": "",
    "INITIALIZATION": "..",
    "ACTOR_TRAINING": "//",
    "CRITIC_TRAINING": "\\\\",
    "OLD_LOG_PROBS": "xx",
    "REF_LOG_PROBS": "++",
    "VALUE_COMPUTE": "oo",
}


def intervals(events: Sequence[Event]) -> list[tuple[int, str, str, float, float]]:
    """(device, pipeline, stage, start, end) for every stretch a device was held."""
    open_: dict[int, tuple[str, str, float]] = {}
    held: dict[tuple[str, str], list[int]] = {}
    out: list[tuple[int, str, str, float, float]] = []
    t_end = max((e.t for e in events), default=0.0)

    def close(d: int, t: float) -> None:
        if d in open_:
            pid, stage, t0 = open_.pop(d)
            out.append((d, pid, stage, t0, t))

    for e in events:
        pid, t = e.pipeline, e.t
        match e:
            case Granted():
                held[(pid, e.cluster)] = e.devices
                for d in e.devices:
                    close(d, t)
                    open_[d] = (pid, e.priority, t)
            case Released():
                for d in held.pop((pid, e.cluster), []):
                    close(d, t)
            case Expanded():
                for d in e.devices:
                    close(d, t)
                    open_[d] = (pid, "GENERATION", t)
            case Shrunk():
                for d in e.devices:
                    if d in open_ and open_[d][0] == pid and open_[d][1] == "GENERATION":
                        close(d, t)
            case Unregistered():
                for d in [d for d, (p, _, _) in open_.items() if p == pid]:
                    close(d, t)
    for d in list(open_):
        close(d, t_end)
    return out


def draw_timeline(journal: str | Path, output: str | Path) -> Path:
    events = list(read_journal(journal))
    spans = intervals(events)
    if not spans:
        raise ValueError(f"{journal}: no grant or expand events to draw")
    t0 = min(s[3] for s in spans)
    pipelines = sorted({s[1] for s in spans})
    cmap = plt.get_cmap("tab10")
    colour = {p: cmap(i % 10) for i, p in enumerate(pipelines)}
    devices = sorted({s[0] for s in spans})
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(devices) + 1.8))
    for d, pid, stage, a, b in spans:
        ax.barh(
            d,
            b - a,
            left=a - t0,
            height=0.8,
            color=colour[pid],
            edgecolor="black",
            linewidth=0.3,
            hatch=HATCH.get(stage, ""),
        )
    ax.set_yticks(devices, [f"dev {d}" for d in devices])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"{Path(journal).name}: device ownership")
    stages = sorted({s[2] for s in spans}, key=lambda s: list(HATCH).index(s) if s in HATCH else 99)
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

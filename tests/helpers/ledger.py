"""What killing a pipeline costs, worked out from what survives the kill.

Call it while the pipeline's processes are stopped (SIGSTOP), just before the kill:
everything the ledger says was asked for is either in the newest checkpoint (trained
into its weights, per metrics.jsonl, or in its buffer), or already out of the running
(failed, discarded, or dropped as stale), or lost to the kill. It reads the ledger's
raw lines, not ``tally``, so it checks the ledger's accounting from the outside."""

from __future__ import annotations

from pathlib import Path

import torch

from rlix_async.rollout.ledger import LEDGER, read_events
from rlix_async.train.checkpoints import latest_checkpoint


def kill_cost(run: Path) -> int:
    """Trajectories that a kill of the (stopped) pipeline at ``run`` makes it do again.
    For a pipeline not restarted before (one incarnation in its ledger)."""
    events = list(read_events(run / LEDGER))
    assert [e["ev"] for e in events if e["ev"] == "start"] == ["start"], "restarted before"
    ckpt = latest_checkpoint(run / "ckpt")
    saved_ids, in_saved, trained = set(), 0, 0
    if ckpt is not None:
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)
        saved_ids = {g["id"] for g in saved["buffer"]["groups"]}
        in_saved = sum(len(g["responses"]) for g in saved["buffer"]["groups"])
        # from the checkpoint, not its step's metrics row: a pipeline stopped between
        # writing the two has the one and not the other
        trained = saved["buffer"]["trained"]
    requested = sum(e["n"] for e in events if e["ev"] == "requested")
    out_of_the_running = 0
    finished: dict[str, int] = {}
    for e in events:
        if e["ev"] == "finished":
            finished[e["g"]] = e["ok"]
            out_of_the_running += e["failed"] + e["cancelled"]
            if e["outcome"] != "buffered":
                out_of_the_running += e["ok"]
        elif e["ev"] == "dropped":  # unless the checkpoint still has it: it comes back
            out_of_the_running += sum(finished[g] for g in e["g"] if g not in saved_ids)
    return requested - trained - in_saved - out_of_the_running

"""Sharded Megatron checkpoints (train/sharded_checkpoint.py) on real files, without a
process group: parts written as the trainer's ranks write them (their own slices,
named as in the full model) read back at the same layout bit for bit, at other tensor
and pipeline sizes as the slices of the full tensors, and assembled into the full
model; a checkpoint missing a part is never promoted; listing and pruning take the
directories beside ``step_N.pt`` files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlix_async.train.checkpoints import checkpoints, latest_checkpoint, prune_checkpoints
from rlix_async.train.pipeline_parallel import EMBEDDING, from_stage, to_stage
from rlix_async.train.sharded_checkpoint import (
    CheckpointError,
    ShardedCheckpoint,
    begin,
    promote,
    rank_part,
    staging,
    write_part,
)
from rlix_async.train.tensor_parallel import shard_tensor

LAYERS, VOCAB = 4, 11  # an odd vocabulary: tensor parallel pads it
PER_LAYER = {
    "input_layernorm.weight": (8,),
    "self_attention.linear_qkv.weight": (12, 8),  # rows
    "self_attention.linear_proj.weight": (8, 8),  # columns
    "mlp.linear_fc1.weight": (16, 8),  # [gate; up]
    "mlp.linear_fc2.weight": (8, 8),
}


def full_model(tied: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {EMBEDDING: torch.randn(VOCAB, 8, generator=g)}
    for i in range(LAYERS):
        for rest, shape in PER_LAYER.items():
            out[f"decoder.layers.{i}.{rest}"] = torch.randn(*shape, generator=g)
    out["decoder.final_layernorm.weight"] = torch.randn(8, generator=g)
    if not tied:
        out["output_layer.weight"] = torch.randn(VOCAB, 8, generator=g)
    return out


def moments(model: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    return {
        k: {"exp_avg": v * 2, "exp_avg_sq": v.abs(), "step": torch.tensor(3.0)}
        for k, v in model.items()
    }


def write(path: Path, tp: int, pp: int, tied: bool) -> dict[str, torch.Tensor]:
    """A checkpoint at ``tp`` x ``pp`` as the trainer's ranks write it: each its own
    stage's entries, its own slices, under the full model's names."""
    model = full_model(tied)
    optim = moments(model)
    begin(path)
    for s in range(pp):
        stage = from_stage(to_stage(model, s, pp, LAYERS, tied), s, pp, LAYERS, tied)
        for t in range(tp):
            mine = {k: shard_tensor(k, v, t, tp) for k, v in stage.items()}  # type: ignore[arg-type]
            states = {
                k: {e: v if not v.dim() else shard_tensor(k, v, t, tp) for e, v in optim[k].items()}
                for k in stage
            }
            names = list(stage)  # the optimizer's order: its state by index
            by_index = {i: states[n] for i, n in enumerate(names)}
            write_part(path, s, t, rank_part(mine, by_index, names, lambda name: name))
    meta = {"tp": tp, "pp": pp, "layers": LAYERS, "tied": tied, "vocab_size": VOCAB, "step": 7}
    promote(path, meta)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_parts_read_back_at_every_layout(tmp_path: Path, tied: bool) -> None:
    model = write(tmp_path / "step_7", 2, 2, tied)
    ckpt = ShardedCheckpoint(tmp_path / "step_7")
    assert ckpt.meta["step"] == 7 and sorted(ckpt.model_names()) == sorted(model)
    whole = ckpt.full_model()
    for k, v in model.items():
        assert torch.equal(whole[k], v), k  # vocabulary padding removed
        for tp in (1, 2):
            for t in range(tp):
                # as written at tp=2 (its zero padding rows too), resharded at tp=1
                assert torch.equal(ckpt.part(k, t, tp), shard_tensor(k, v, t, tp)), (k, tp, t)
                assert torch.equal(ckpt.part(k, t, tp, "exp_avg"), shard_tensor(k, v * 2, t, tp)), (
                    k,
                    tp,
                    t,
                )
        assert ckpt.part(k, 1, 2, "step").item() == 3.0
        assert sorted(ckpt.optim_keys(k)) == ["exp_avg", "exp_avg_sq", "step"]
    # a tp=1 x pp=2 checkpoint read at tp=2: split for the first time
    write(tmp_path / "step_8", 1, 2, tied)
    other = ShardedCheckpoint(tmp_path / "step_8")
    qkv = "decoder.layers.3.self_attention.linear_qkv.weight"
    assert torch.equal(other.part(qkv, 1, 2), shard_tensor(qkv, model[qkv], 1, 2))
    assert other.part(EMBEDDING, 1, 2).shape == (6, 8)  # 11 rows padded to 12, 6 each


def test_a_missing_part_is_refused_and_nothing_is_promoted(tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "step_2"
    begin(path)
    write_part(path, 0, 0, {"model/x": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"part-pp0-tp1\.safetensors.*shared filesystem"):
        promote(path, {"tp": 2, "pp": 1})
    assert not path.exists() and staging(path).is_dir()
    assert checkpoints(tmp_path / "ckpt") == []  # the staging directory is never listed


def test_a_torn_or_foreign_checkpoint_is_one_line(tmp_path: Path) -> None:
    write(tmp_path / "step_1", 2, 1, tied=False)
    (tmp_path / "step_1" / "part-pp0-tp1.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match=r"part-pp0-tp1\.safetensors: unreadable"):
        ShardedCheckpoint(tmp_path / "step_1")
    (tmp_path / "step_1" / "part-pp0-tp1.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"part-pp0-tp1\.safetensors is missing"):
        ShardedCheckpoint(tmp_path / "step_1")
    torch.save({"format": "something else"}, tmp_path / "step_1" / "meta.pt")
    with pytest.raises(CheckpointError, match=r"meta\.pt: unreadable"):
        ShardedCheckpoint(tmp_path / "step_1")


def test_listing_and_pruning_take_directories_beside_files(tmp_path: Path) -> None:
    torch.save({}, tmp_path / "step_1.pt")
    write(tmp_path / "step_2", 2, 1, tied=True)
    torch.save({}, tmp_path / "step_10.pt")
    write(tmp_path / "step_3", 1, 2, tied=True)
    (tmp_path / "step_4.tmp").write_bytes(b"")  # a file being written
    begin(tmp_path / "step_5")  # a sharded one being written
    (tmp_path / "step_6").mkdir()  # a directory with no meta: never promoted
    names = [p.name for p in checkpoints(tmp_path)]
    assert names == ["step_1.pt", "step_2", "step_3", "step_10.pt"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10.pt"
    gone = prune_checkpoints(tmp_path, keep=1)
    assert [p.name for p in gone] == ["step_1.pt", "step_2", "step_3"]
    assert not (tmp_path / "step_2").exists() and not (tmp_path / "step_3").exists()
    assert [p.name for p in checkpoints(tmp_path)] == ["step_10.pt"]


def test_the_optimizer_step_count_survives_resharding(tmp_path: Path) -> None:
    write(tmp_path / "step_7", 2, 2, tied=False)
    ckpt = ShardedCheckpoint(tmp_path / "step_7")
    for name in ckpt.model_names():
        for tp, rank in ((1, 0), (4, 3)):  # merged, and split finer than written
            if tp == 1 or name.endswith("layernorm.weight"):
                assert ckpt.part(name, rank, tp, "step").item() == 3.0


def test_a_rank_that_cannot_write_fails_every_rank_with_its_reason(tmp_path: Path) -> None:
    """Over a real (one-rank) gloo group: the success flag's all-reduce raises where a
    bare barrier would have left the other ranks waiting."""
    import torch.distributed as dist

    from rlix_async.train.sharded_checkpoint import write_parts

    (tmp_path / "ckpt").write_text("a file where the directory should be")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(CheckpointError, match=r"step_1: (NotADirectoryError|FileExistsError)"):
            write_parts(tmp_path / "ckpt" / "step_1", 0, lambda: {}, (0, 0, 0), torch.device("cpu"))
        ok = tmp_path / "ok" / "step_1"
        write_parts(ok, 0, lambda: {"model/x": torch.ones(2)}, (0, 0, 0), torch.device("cpu"))
        assert (staging(ok) / "part-pp0-tp0.safetensors").is_file()
    finally:
        dist.destroy_process_group()

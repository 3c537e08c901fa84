"""Pack named tensors into contiguous byte buckets, and read them back zero-copy.

The layout (names, dtypes, shapes, bucket and offset of each tensor) depends
only on the model's parameter list, so it is computed once and reused every
step; a sync then only needs the version id. Offsets are 512-byte aligned, so
every tensor view is aligned for any dtype and for direct-I/O style copies.
A tensor larger than the bucket size gets a bucket of its own.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from rlix_async.protocols.cache_ref import Entry, Layout

ALIGN = 512

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype} for weight packing") from None


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_layout(
    params: Iterable[tuple[str, torch.dtype, Sequence[int]]], bucket_bytes: int
) -> Layout:
    """First-fit in declaration order (keeps a layer's tensors together)."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}")
    entries: list[Entry] = []
    sizes: list[int] = []
    current = -1
    seen: set[str] = set()
    for name, dtype, shape in params:
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        seen.add(name)
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        size = _align(max(nbytes, 1))
        if size > bucket_bytes:  # oversized: a bucket of its own
            sizes.append(size)
            entries.append(Entry(name, dtype_name(dtype), tuple(shape), len(sizes) - 1, 0, nbytes))
            current = -1
            continue
        if current < 0 or sizes[current] + size > bucket_bytes:
            sizes.append(0)
            current = len(sizes) - 1
        entries.append(
            Entry(name, dtype_name(dtype), tuple(shape), current, sizes[current], nbytes)
        )
        sizes[current] += size
    return Layout(tuple(entries), tuple(sizes), bucket_bytes)


def layout_of(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> Layout:
    return plan_layout(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_bytes)


@dataclass
class BucketView:
    """One bucket's bytes with the tensors inside it, as zero-copy views."""

    index: int
    data: memoryview

    def tensors(self, layout: Layout) -> list[tuple[str, torch.Tensor]]:
        raw = torch.frombuffer(self.data, dtype=torch.uint8) if len(self.data) else None
        out = []
        for e in layout.in_bucket(self.index):
            if raw is None or e.nbytes == 0:
                t = torch.empty(e.shape, dtype=_DTYPES[e.dtype])
            else:
                t = raw[e.offset : e.offset + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape)
            out.append((e.name, t))
        return out


def pack_into(tensors: Mapping[str, torch.Tensor], layout: Layout, dest: memoryview) -> None:
    """Copy every tensor to its place in ``dest`` (all buckets back to back).

    A CUDA tensor is copied straight from the device into its place with one
    asynchronous copy, and each device is synchronized once at the end: no
    pageable host temporary. Into page-locked memory (the weight cache's slots
    are registered with CUDA) these copies run at DMA speed; into pageable
    memory they are still correct, the driver stages them.
    """
    if len(dest) < layout.total_bytes:
        raise ValueError(f"destination holds {len(dest)} bytes, layout needs {layout.total_bytes}")
    raw = torch.frombuffer(dest, dtype=torch.uint8)
    starts = layout.bucket_offsets
    devices: set[torch.device] = set()
    for e in layout.entries:
        t = tensors.get(e.name)
        if t is None:
            raise KeyError(f"tensor {e.name!r} missing from the state to pack")
        if dtype_name(t.dtype) != e.dtype or tuple(t.shape) != e.shape:
            raise ValueError(
                f"{e.name}: {t.dtype}{tuple(t.shape)} does not match the layout "
                f"({e.dtype}{e.shape}); recompute the layout"
            )
        if e.nbytes:
            start = starts[e.bucket] + e.offset
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            on_cuda = src.device.type == "cuda"
            raw[start : start + e.nbytes].copy_(src, non_blocking=on_cuda)
            if on_cuda:
                devices.add(src.device)
    for device in devices:  # the bytes are in dest only once the copies finished
        torch.cuda.synchronize(device)


def buckets_of(layout: Layout, segment: memoryview) -> list[BucketView]:
    starts = layout.bucket_offsets
    return [
        BucketView(i, segment[s : s + n])
        for i, (s, n) in enumerate(zip(starts, layout.bucket_sizes, strict=True))
    ]


def bucket_checksums(layout: Layout, buf: memoryview) -> list[int]:
    """CRC32 of every bucket of a packed version (to verify a transfer end to end)."""
    return [zlib.crc32(b.data) for b in buckets_of(layout, buf)]

"""The registry's fence table against a plain dict, over random changes: the device
index answers ``covering`` and ``devices`` exactly as scanning every fence would, and
``take_changed`` names every key set or lifted since the last call (the coordinator
journals exactly those)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix_async.control.fences import Fence, FenceKey, FenceTable

KEYS = st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 3))
DEVICES = st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), KEYS, DEVICES),
        st.tuples(st.just("pop"), KEYS, st.just([])),
        st.tuples(st.just("clear"), KEYS, st.just([])),
        st.tuples(st.just("take"), KEYS, st.just([])),
    ),
    max_size=40,
)


def fence(key: FenceKey, devices: list[int]) -> Fence:
    return Fence(key[0], key[1], tuple(devices), None, "test", 0.0)


@settings(max_examples=300, deadline=None)
@given(OPS, st.lists(DEVICES, min_size=1, max_size=5))
def test_the_index_answers_as_a_scan_of_every_fence_would(
    ops: list[tuple[str, FenceKey, list[int]]], questions: list[list[int]]
) -> None:
    table, plain = FenceTable(), dict[FenceKey, Fence]()
    touched: set[FenceKey] = set()
    for op, key, devices in ops:
        if op == "set":  # overlapping fences are allowed: the index keeps each
            table[key] = plain[key] = fence(key, devices)
            touched.add(key)
        elif op == "pop":  # lifting what is not there changes nothing
            if key in plain:
                touched.add(key)
            assert table.pop(key, None) is plain.pop(key, None)
        elif op == "clear":
            touched.update(plain)
            table.clear()
            plain.clear()
        else:
            assert table.take_changed() == touched
            touched = set()
        assert dict(table) == plain
        assert table.devices() == {d for f in plain.values() for d in f.devices}
        for q in questions:
            scan = [f for k, f in sorted(plain.items()) if set(q) & set(f.devices)]
            assert table.covering(q) == scan
    assert table.take_changed() == touched
    assert table.take_changed() == set()


def test_a_fence_set_again_on_other_devices_leaves_the_old_ones() -> None:
    table = FenceTable()
    table[("a", 0)] = fence(("a", 0), [0, 1])
    table[("a", 0)] = fence(("a", 0), [2])
    assert table.covering([0, 1]) == []
    assert table.devices() == {2}


def test_popping_what_is_not_there_without_a_default_raises() -> None:
    with pytest.raises(KeyError):
        FenceTable().pop(("a", 0))

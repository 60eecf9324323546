"""bench/pd_ttft.py's `--pin` plans and bench/host_load.py's grouping of CPUs by physical core: whole cores per
process, the PD sides sharing theirs only when asked, and a clear refusal on a host with too few."""

from __future__ import annotations

import pytest

from bench.host_load import physical_cores
from bench.pd_ttft import PIN_ROLES, pin_plan
from canary.pd_target import embedded_pd_pair


def write_topology(root, cpus: dict[int, tuple[int, int]]) -> None:
    """A fake /sys/devices/system/cpu: CPU -> (package, core id)."""
    for cpu, (package, core) in cpus.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")


def test_cpus_are_grouped_by_package_and_core(tmp_path):
    # Linux numbers SMT siblings apart (0 and 8 share a core) and core ids repeat across packages.
    write_topology(tmp_path, {0: (0, 0), 8: (0, 0), 1: (0, 1), 9: (0, 1), 2: (1, 0), 10: (1, 0)})
    assert physical_cores([0, 1, 2, 8, 9, 10, 11], sys_cpu=tmp_path) == [[0, 8], [1, 9], [2, 10], [11]]


def smt_host(cores: int) -> list[list[int]]:
    return [[core, core + cores] for core in range(cores)]


def _whole_cores(plan: dict[str, list[int]], cores: list[list[int]]) -> bool:
    """Each role's CPUs are whole cores of `cores`, and no two roles share one."""
    owner = {}
    for role, cpus in plan.items():
        for core in cores:
            if set(core) & set(cpus):
                if not set(core) <= set(cpus) or owner.setdefault(tuple(core), role) != role:
                    return False
    return True


def test_apart_gives_every_process_whole_cores_of_its_own_and_the_servers_what_is_left():
    cores = smt_host(8)
    plan = pin_plan("apart", sorted(cpu for core in cores for cpu in core), cores)
    assert list(plan) == list(PIN_ROLES)
    assert _whole_cores(plan, cores)
    # client and router one core each; the 6 cores left go to the three servers, two each
    assert [len(plan[role]) for role in PIN_ROLES] == [2, 2, 4, 4, 4]


def test_without_smt_each_process_gets_two_cpus_and_the_servers_share_the_rest():
    cores = [[cpu] for cpu in range(16)]
    plan = pin_plan("apart", list(range(16)), cores)
    assert plan["client"] == [0, 1] and plan["router"] == [2, 3]
    assert plan["prefill"] == [4, 5, 6, 7] and plan["decode"] == [8, 9, 10, 11]
    assert plan["colocated"] == [12, 13, 14, 15]
    # control: exactly enough CPUs for the minimum leaves every role at two
    assert [len(cpus) for cpus in pin_plan("apart", list(range(10)), cores[:10]).values()] == [2] * 5
    # a remainder that cannot go to every server equally is left unused
    assert [len(cpus) for cpus in pin_plan("apart", list(range(12)), cores[:12]).values()] == [2] * 5


def test_apart_swapped_trades_the_prefill_and_colocated_servers_cpus_and_nothing_else():
    cores = [[cpu] for cpu in range(16)]
    apart = pin_plan("apart", list(range(16)), cores)
    swapped = pin_plan("apart-swapped", list(range(16)), cores)
    assert swapped["prefill"] == apart["colocated"] == [12, 13, 14, 15]
    assert swapped["colocated"] == apart["prefill"] == [4, 5, 6, 7]
    assert all(swapped[role] == apart[role] for role in ("client", "router", "decode"))


def test_cores_of_unequal_sizes_never_leave_a_role_on_one_cpu():
    # the servers move later by the extra cores: a lone CPU where a pair stood at their first places
    cores = [[0, 1], [2], [3], [4, 5], [6, 7], [8, 9], [10], [11], [12]]
    plan = pin_plan("apart", sorted(cpu for core in cores for cpu in core), cores)
    assert all(len(cpus) >= 2 for cpus in plan.values()) and _whole_cores(plan, cores)


def test_pd_shared_puts_both_pd_sides_on_the_same_cores_and_the_rest_apart():
    cores = smt_host(8)
    plan = pin_plan("pd-shared", sorted(cpu for core in cores for cpu in core), cores)
    assert plan["prefill"] == plan["decode"]
    others = {role: plan[role] for role in PIN_ROLES if role != "decode"}
    assert _whole_cores(others, cores)
    assert len(plan["prefill"]) == len(plan["colocated"])  # the pair's share is the colocated server's


def test_a_host_with_too_few_cpus_is_refused_naming_what_is_needed():
    with pytest.raises(ValueError, match="needs two CPUs for each of client, router"):
        pin_plan("apart", [0, 1], [[0], [1]])
    with pytest.raises(ValueError, match="unknown pinning"):
        pin_plan("spread", list(range(16)), [[cpu] for cpu in range(16)])


def test_a_pd_pair_refuses_pins_for_a_role_it_does_not_have():
    with pytest.raises(ValueError, match="no PD role named"):
        with embedded_pd_pair("unused", cpus={"colocated": [0]}):
            pass

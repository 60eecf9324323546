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


def test_apart_gives_every_process_a_whole_core_of_its_own():
    cores = smt_host(8)
    plan = pin_plan("apart", sorted(cpu for core in cores for cpu in core), cores)
    assert list(plan) == list(PIN_ROLES)
    assert all(plan[role] in cores for role in PIN_ROLES)
    assert len({tuple(cpus) for cpus in plan.values()}) == len(PIN_ROLES)


def test_without_smt_each_process_gets_two_cores():
    cores = [[cpu] for cpu in range(16)]
    plan = pin_plan("apart", list(range(16)), cores)
    assert plan["client"] == [0, 1] and plan["colocated"] == [8, 9]


def test_pd_shared_puts_both_pd_sides_on_one_core_and_the_rest_apart():
    cores = smt_host(8)
    plan = pin_plan("pd-shared", sorted(cpu for core in cores for cpu in core), cores)
    assert plan["prefill"] == plan["decode"]
    others = [tuple(plan[role]) for role in PIN_ROLES if role != "decode"]
    assert len(set(others)) == len(others)


def test_a_host_with_too_few_cpus_is_refused_naming_what_is_needed():
    with pytest.raises(ValueError, match="needs two CPUs for each of client, router"):
        pin_plan("apart", [0, 1], [[0], [1]])
    with pytest.raises(ValueError, match="unknown pinning"):
        pin_plan("spread", list(range(16)), [[cpu] for cpu in range(16)])


def test_a_pd_pair_refuses_pins_for_a_role_it_does_not_have():
    with pytest.raises(ValueError, match="no PD role named"):
        with embedded_pd_pair("unused", cpus={"colocated": [0]}):
            pass

"""`--server-cpus`: the gate's embedded server on the CPUs asked for (issue 17: the H200's A/B error rates were met
with both servers on the same CPUs), the list read as taskset writes it, and a bad one refused at startup."""

from __future__ import annotations

import json
import os

import pytest

from canary.targets import parse_cpu_list

pytestmark = pytest.mark.unit

pytest_plugins = ["pytester"]


def test_cpu_lists_read_as_taskset_writes_them():
    assert parse_cpu_list("4,5") == [4, 5]
    assert parse_cpu_list("4-7") == [4, 5, 6, 7]
    assert parse_cpu_list("0, 4-5,5") == [0, 4, 5]
    for bad, says in (("", "not a CPU number"), ("4,", "not a CPU number"), ("a-b", "not a CPU number"),
                      ("-3", "not a CPU number"), ("4-", "not a CPU number"), ("7-4", "runs backwards")):
        with pytest.raises(ValueError, match=says):
            parse_cpu_list(bad)


# A conftest whose embedded server is a stand-in that records how it was asked to start, and a gate test
# that only takes the target: what the fixture hands `embedded_server` is what is checked.
_CONFTEST = '''
import json, os
from contextlib import contextmanager
import canary.targets
pytest_plugins = ["canary.pytest_plugin"]

@contextmanager
def fake_server(model, args=(), **kwargs):
    with open(os.environ["STARTS"], "a") as out:
        out.write(json.dumps({"cpus": kwargs.get("cpus")}) + "\\n")
    yield canary.targets.Target("fake", "http://127.0.0.1:1/v1", "m", True)

canary.targets.embedded_server = fake_server
'''
_GATE = '''
import json, os
def test_gate(canary_target):
    assert canary_target.name == "fake"
    with open(os.environ["STARTS"], "a") as out:
        out.write(json.dumps({"harness": sorted(os.sched_getaffinity(0))}) + "\\n")
'''


def _run(pytester, monkeypatch, starts, *args):
    """The gate with `args`; the servers it asked for, from the stand-in's record in `starts`."""
    pytester.makeconftest(_CONFTEST)
    pytester.makepyfile(_GATE)
    monkeypatch.setenv("STARTS", str(starts))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--model", "tiny-random", *args)
    return result, [json.loads(line) for line in starts.read_text().splitlines()] if starts.exists() else []


def test_the_embedded_server_starts_on_the_cpus_asked_for_and_the_harness_runs_on_the_others(
        pytester, monkeypatch, tmp_path):
    mine = sorted(os.sched_getaffinity(0))
    cpu = mine[-1]
    result, starts = _run(pytester, monkeypatch, tmp_path / "pinned.jsonl", f"--server-cpus={cpu}")
    result.assert_outcomes(passed=1)
    assert starts == [{"cpus": [cpu]}, {"harness": mine[:-1] or mine}]
    result.stdout.fnmatch_lines([f"embedded server on CPUs [[]{cpu}[]], the harness on *(--server-cpus)"])
    # Negative control: without the option the scheduler places the server (no CPU list reaches it) and the
    # harness keeps every CPU.
    result, starts = _run(pytester, monkeypatch, tmp_path / "free.jsonl")
    result.assert_outcomes(passed=1)
    assert starts == [{"cpus": None}, {"harness": mine}]
    result.stdout.no_fnmatch_line("*embedded server on CPUs*")


def test_the_harness_gets_its_cpus_back_when_the_server_stops():
    from canary.targets import cpus_apart

    mine = os.sched_getaffinity(0)
    taken = {max(mine)}
    with cpus_apart(taken):
        assert os.sched_getaffinity(0) == (mine - taken or mine)
    assert os.sched_getaffinity(0) == mine


@pytest.mark.parametrize("args, says", [
    (["--server-cpus=4-"], "not a CPU number"),
    ([f"--server-cpus={max(os.sched_getaffinity(0)) + 1000}"], "not among this process's CPUs"),
    (["--server-cpus=0", "--base-url=http://127.0.0.1:1/v1"], "not with --base-url"),
    (["--server-cpus=0", "--pd"], "not with --pd"),
])
def test_a_cpu_list_the_gate_cannot_use_is_refused_at_startup(pytester, monkeypatch, tmp_path, args, says):
    result, starts = _run(pytester, monkeypatch, tmp_path / "starts.jsonl", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--server-cpus*{says}*"])
    assert starts == []

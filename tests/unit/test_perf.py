"""Step-time fit, cliff detection, the machine-speed probe and baseline fingerprints (the verdict's
statistics: test_perf_verdict.py)."""

from __future__ import annotations

import math

import pytest

from canary.perf.machine_speed import probe
from canary.perf.verdict import find_cliffs, fit_step_time, percentile

pytestmark = pytest.mark.unit


def test_fit_recovers_a_known_line():
    bs = [1, 2, 4, 8, 16, 32]
    fit = fit_step_time(bs, [0.018 + 0.00105 * b for b in bs])
    assert math.isclose(fit.a, 0.018, rel_tol=1e-9) and math.isclose(fit.b, 0.00105, rel_tol=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    with pytest.raises(ValueError):
        fit_step_time([4, 4], [1.0, 2.0])


def test_cliffs_are_flagged_only_where_throughput_drops():
    levels = [8, 9, 16, 17, 18]
    assert find_cliffs(levels, [100, 105, 180, 150, 158]) == [
        {"from": 16, "to": 17, "before": 180, "after": 150, "drop": pytest.approx(1 / 6)}]
    assert find_cliffs(levels, [100, 110, 120, 130, 140]) == []


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(percentile([], 50))


def test_probe_measures_blocks_per_second():
    assert 0 < probe(0.05) < 1e6
    with pytest.raises(ValueError):
        probe(0)


def test_a_baseline_belongs_to_its_kernels_and_its_trial_workload():
    from canary.gate import trials_fingerprint
    from canary.perf.trial_load import TrialWorkload
    from canary.provenance import fingerprint
    from canary.targets import Target

    target, workload = Target("t", "http://x/v1", "canary-moe-v2", True), TrialWorkload()
    older = trials_fingerprint(target, {"model": "m"}, workload)  # a server without engine_config
    default = trials_fingerprint(target, {"model": "m", "engine_config": {"moe_kernel": "torch",
                                                                        "attention_kernel": "torch"}}, workload)
    triton = trials_fingerprint(target, {"model": "m", "engine_config": {"attention_kernel": "triton"}}, workload)
    assert fingerprint(older) == fingerprint(default) != fingerprint(triton)
    assert triton["triton_kernels"] == ["attention"]
    other = trials_fingerprint(target, {"model": "m"}, TrialWorkload(concurrency=(4,)))
    assert fingerprint(other) != fingerprint(older)
    # A bfloat16 server is another speed: its baseline is its own (one recorded on the H200 overwrote
    # the float32 file before the dtype was part of the key).
    float32 = trials_fingerprint(target, {"model": "m", "engine_config": {"dtype": "float32"}}, workload)
    bf16 = trials_fingerprint(target, {"model": "m", "engine_config": {"dtype": "bfloat16"}}, workload)
    assert fingerprint(float32) == fingerprint(older) != fingerprint(bf16)
    # The prefix cache and a PD pair are other speeds too; off and colocated keep the old keys (the
    # stored H200 baselines were recorded without the cache, colocated).
    plain = trials_fingerprint(target, {"model": "m", "prefix_cache": False, "disaggregation": None}, workload)
    cached = trials_fingerprint(target, {"model": "m", "prefix_cache": True}, workload)
    pair = trials_fingerprint(target, {"model": "m", "disaggregation": "decode"}, workload)
    assert fingerprint(plain) == fingerprint(older)
    assert len({fingerprint(plain), fingerprint(cached), fingerprint(pair)}) == 3


def test_the_stored_baselines_are_filed_under_their_own_keys(tmp_path):
    """Control for the rule above: a baseline's file name is the fingerprint of the key it holds, read
    back from its JSON (a key the JSON changes, or a file renamed or edited by hand, would hash another
    way), for one recorded now as the gate records it (`--baseline-update`) and for every committed one
    (none since the default workload became 5 bursts a level: the H200's are to be recorded again)."""
    import json
    from pathlib import Path

    from canary.gate import trials_fingerprint
    from canary.perf.trial_load import TrialWorkload
    from canary.perf.verdict import save_trials_baseline
    from canary.provenance import fingerprint
    from canary.targets import Target

    key = trials_fingerprint(Target("t", "http://x/v1", "canary-moe-v2", True),
                             {"model": "m", "engine_config": {"dtype": "bfloat16"}, "prefix_cache": True},
                             TrialWorkload(concurrency=(1, 8), logprobs=False))
    recorded = tmp_path / f"{fingerprint(key)}.json"
    save_trials_baseline(recorded, key, {"workload": TrialWorkload().describe(), "trials": [], "machine_speed": None})
    committed = sorted((Path(__file__).resolve().parents[2] / "golden" / "baselines").glob("*.json"))
    for path in [recorded, *committed]:
        assert fingerprint(json.loads(path.read_text())["fingerprint"]) == path.stem, path.name


def test_the_error_rate_bench_takes_the_gates_workload_json():
    """bench.perf_verdict_trials reads the trial workload as the gate's --perf-workload does: the
    same keys, checked before any server starts."""
    import argparse

    from bench.perf_verdict_trials import workload_arg
    from canary.perf.trial_load import TrialWorkload

    assert workload_arg('{"concurrency": [8], "ttft_rate": 16, "rounds": 10}') == TrialWorkload(
        concurrency=(8,), ttft_rate=16, rounds=10)
    for bad in ('{"rounds": 0}', '{"concurency": [8]}', "[8]", "{"):
        with pytest.raises(argparse.ArgumentTypeError):
            workload_arg(bad)


def test_the_error_rate_report_names_the_metric_that_alarms(capsys):
    """The trials' report breaks each kind's verdicts down by metric (status counts, median interval
    width), so a failing bar says which metric cried wolf. Two clean runs where only TTFT alarmed."""
    from bench.perf_verdict_trials import by_metric, report

    def verdict(metric, status, low, high):
        return {"metric": metric, "status": status, "low": low, "high": high, "trials": 12}

    rows = [{"mode": "ab", "kind": "clean", "run": i, "status": status,
             "verdicts": [verdict("decode_tok_s@8", "ok", 0.97, 1.03), verdict("ttft_s@16rps", status, *bounds)]}
            for i, (status, bounds) in enumerate([("ok", (0.98, 1.02)), ("inconclusive", (0.90, 1.20))])]
    rows.append({"mode": "ab", "kind": "slowed", "run": 0, "status": "slower",
                 "verdicts": [verdict("decode_tok_s@8", "slower", 1.06, 1.14)]})
    counts = by_metric(rows, "ab", "clean")
    assert counts["decode_tok_s@8"]["ok"] == 2 and counts["decode_tok_s@8"]["inconclusive"] == 0
    assert counts["ttft_s@16rps"]["inconclusive"] == 1 and round(counts["ttft_s@16rps"]["median_width"], 2) == 0.30
    assert not report(rows, ["ab"], 10.0)  # one clean alarm: the bar is not met
    printed = capsys.readouterr().out
    assert "clean ttft_s@16rps: ok 1, slower 0, inconclusive 1" in printed
    assert "slowed decode_tok_s@8: ok 0, slower 1" in printed


def test_the_error_rate_series_refuses_runs_of_another_machine(tmp_path):
    """Resuming a series on another GPU (what an H100 lent in place of an H200 did) must not add its runs
    to the first machine's error rates: the file's runs of another device are refused by name."""
    import json

    from bench.perf_verdict_trials import done_runs

    out = tmp_path / "trials.jsonl"
    row = {"mode": "ab", "kind": "clean", "run": 0, "status": "ok", "device": "NVIDIA H200"}
    out.write_text(json.dumps(row) + "\n")
    assert len(done_runs(out, "NVIDIA H200")) == 1 and len(done_runs(out)) == 1
    with pytest.raises(ValueError, match="holds runs of NVIDIA H200, and this is NVIDIA H100"):
        done_runs(out, "NVIDIA H100 80GB HBM3")
    assert done_runs(tmp_path / "none.jsonl", "NVIDIA H100 80GB HBM3") == []


def test_a_series_is_not_resumed_with_another_pinning(tmp_path):
    import json

    from bench.perf_verdict_trials import done_runs

    out = tmp_path / "trials.jsonl"
    out.write_text(json.dumps({"mode": "ab", "kind": "clean", "run": 0, "status": "ok"}) + "\n")
    assert len(done_runs(out, method={"pin": None})) == 1
    with pytest.raises(ValueError, match="holds runs of pin None, and this series' is shared"):
        done_runs(out, method={"pin": "shared"})
    out.write_text(json.dumps({"mode": "ab", "kind": "clean", "run": 0, "status": "ok", "pin": "apart"}) + "\n")
    assert len(done_runs(out, method={"pin": "apart"})) == 1
    for other in (None, "shared"):
        with pytest.raises(ValueError, match="holds runs of pin apart"):
            done_runs(out, method={"pin": other})


def test_pinning_splits_the_cpus_apart_or_puts_both_sides_on_the_same_two():
    from bench.perf_verdict_trials import cpu_split

    assert cpu_split(list(range(16)), "apart") == {"harness": [0, 1, 2, 3], "baseline": [4, 5, 6, 7, 8, 9],
                                                   "candidates": list(range(10, 16))}
    assert cpu_split(list(range(16)), "shared") == {"harness": [0, 1, 2, 3], "baseline": [4, 5],
                                                    "candidates": [4, 5]}
    for mode in ("apart", "shared"):
        small = cpu_split([5, 3, 1], mode)
        assert set(sum(small.values(), [])) == {1, 3, 5} and all(small.values())
        assert not set(small["harness"]) & set(small["baseline"] + small["candidates"])
    with pytest.raises(ValueError, match="at least 3 CPUs"):
        cpu_split([0, 1])
    with pytest.raises(ValueError, match="unknown pinning 'near'"):
        cpu_split(list(range(16)), "near")


def test_a_pinned_command_runs_on_the_given_cpus_only():
    """The trampoline sets the mask and then becomes the command: the command itself (here a Python that
    prints its own mask, from a thread it starts, as the server's engine thread would be) sees only them."""
    import os
    import subprocess
    import sys

    from canary.targets import pinned_command

    cpu = min(os.sched_getaffinity(0))
    probe = ("import os, threading; r = []; t = threading.Thread(target=lambda: r.append(os.sched_getaffinity(0))); "
             "t.start(); t.join(); print(sorted(r[0]), os.getpid())")
    # The same pid (exec, not a child): the host sampler reads the server's threads by the pid it started.
    proc = subprocess.Popen(pinned_command([sys.executable, "-c", probe], [cpu]), stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split() == [f"[{cpu}]", str(proc.pid)]
    with pytest.raises(ValueError, match="not among this process's CPUs"):
        pinned_command([sys.executable], [max(os.sched_getaffinity(0)) + 1000])


def test_a_pinned_series_starts_its_servers_before_it_narrows_its_own_cpus(tmp_path, monkeypatch):
    """A process may give its children only CPUs it holds (`pinned_command` checks it): pinning the harness
    to its quarter first would refuse the servers' CPUs. The run goes through main with the servers and
    the trials faked; the mask is a fake 8-CPU one."""
    import json
    import os
    from contextlib import contextmanager

    import bench.perf_verdict_trials as trials_bench
    from canary.perf.trials import TrialsOutcome
    from canary.targets import Target, pinned_command

    mask = {"cpus": set(range(8))}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(mask["cpus"]))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: mask.update(cpus=set(cpus)))
    started: list[list[str]] = []

    @contextmanager
    def fake_server(model, args, *, cpus=None, **_):
        started.append(pinned_command(["/bin/true"], cpus))  # raises if the CPUs are not the harness's to give
        yield Target("fake", "http://127.0.0.1:1/v1", model, True)

    monkeypatch.setattr(trials_bench, "embedded_server", fake_server)
    monkeypatch.setattr(trials_bench, "ab_trials", lambda *a, **k: TrialsOutcome("ab", "ok", []))
    out = tmp_path / "trials.jsonl"
    trials_bench.main(["--runs", "1", "--mode", "ab", "--pin", "shared", "--out", str(out)])
    assert len(started) == 3 and {cmd[3] for cmd in started} == {"2,3"}  # both sides' servers on CPUs 2 and 3
    assert mask["cpus"] == {0, 1}  # then the harness on its quarter
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["pin"] for r in rows] == ["shared", "shared"]
    assert rows[0]["cpus"] == {"harness": [0, 1], "baseline": [2, 3], "candidates": [2, 3]}

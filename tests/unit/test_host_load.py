"""bench/host_load.py: deltas of the host's steal time and of each server's threads, from /proc."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bench.host_load import HostSampler, stat_times, summary, thread_times


def write_proc(root: Path, cpu: list[int], threads: dict[int, tuple[int, int, int]], pid: int = 7,
               per_cpu: dict[int, list[int]] | None = None) -> None:
    """A fake /proc: the host's cpu line (and per-CPU lines) and one process's threads as (utime, stime,
    last cpu)."""
    root.mkdir(exist_ok=True)
    lines = ["cpu  " + " ".join(map(str, cpu))]
    lines += [f"cpu{n} " + " ".join(map(str, v)) for n, v in (per_cpu or {}).items()]
    (root / "stat").write_text("\n".join([*lines, "cpu9 1 2 3", "intr 5 6"]) + "\n")
    for tid, (utime, stime, last) in threads.items():
        task = root / str(pid) / "task" / str(tid)
        task.mkdir(parents=True, exist_ok=True)
        # Fields after the name: state, then 10 more up to utime (14th field) ... processor is the 39th.
        rest = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 23 + [str(last)] + ["0"] * 5
        (task / "stat").write_text(f"{tid} (py thr (x)) " + " ".join(rest) + "\n")


def test_deltas_name_the_steal_and_the_busiest_thread(tmp_path):
    # user nice system idle iowait irq softirq steal
    write_proc(tmp_path, [100, 0, 50, 800, 10, 0, 0, 40], {11: (10, 5, 3), 12: (1, 0, 4)})
    sampler = HostSampler({"candidate": 7, "gone": 99}, proc=tmp_path)
    write_proc(tmp_path, [160, 0, 60, 900, 10, 0, 0, 70], {11: (50, 5, 6), 12: (1, 0, 4), 13: (2, 0, 1)})
    sample = sampler.sample()
    tick = sampler.tick_ms
    assert sample["steal_pct"] == pytest.approx(100 * 30 / 200) and sample["iowait_pct"] == 0
    assert sample["candidate"] == {"cpu_ms": pytest.approx(42 * tick, abs=0.1),
                                   "busiest_thread_ms": pytest.approx(40 * tick, abs=0.1),
                                   "busiest_thread_cpu": 6, "threads_ran": 2}
    assert "gone" not in sample  # a process that is not there gives no entry, not an error
    assert sampler.sample()["candidate"]["cpu_ms"] == 0  # the next sample: since this one


def test_the_steal_of_the_busiest_threads_own_cpu_is_read(tmp_path):
    """A neighbour may take one vCPU only: the host-wide steal dilutes it over all, the CPU's own shows it."""
    host = [100, 0, 50, 800, 10, 0, 0, 40]
    write_proc(tmp_path, host, {11: (10, 5, 3)}, per_cpu={3: [10, 0, 5, 80, 0, 0, 0, 5], 6: [10, 0, 5, 80, 0, 0, 0, 5]})
    sampler = HostSampler({"candidate": 7}, proc=tmp_path)
    # CPU 6 (where the thread ran last) lost 50 of its 100 ticks; CPU 3 none.
    write_proc(tmp_path, host, {11: (50, 5, 6)},
               per_cpu={3: [60, 0, 5, 130, 0, 0, 0, 5], 6: [40, 0, 5, 100, 0, 0, 0, 55]})
    assert sampler.sample()["candidate"]["busiest_cpu_steal_pct"] == 50.0
    assert set(stat_times(tmp_path)[1]) == {3, 6}  # the short cpu9 line and other lines are skipped


def test_unreadable_proc_gives_empty_samples(tmp_path):
    assert stat_times(tmp_path) == (None, {}) and thread_times(1, tmp_path) == {}
    assert HostSampler({"a": 1}, proc=tmp_path).sample() == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_this_process_is_seen_working():
    sampler = HostSampler({"me": os.getpid()})
    sum(i * i for i in range(3_000_000))  # ~0.2 s of CPU on this thread
    mine = sampler.sample()["me"]
    assert mine["busiest_thread_ms"] > 20 and mine["cpu_ms"] >= mine["busiest_thread_ms"]
    assert 0 <= mine["busiest_thread_cpu"] < os.cpu_count()


def test_the_summary_counts_samples_whose_busiest_threads_shared_a_cpu():
    def sample(steal, cpu_a, cpu_b):
        side = lambda cpu: {"cpu_ms": 1.0, "busiest_thread_ms": 1.0, "busiest_thread_cpu": cpu, "threads_ran": 1}  # noqa: E731
        return {"trial": 0, "steal_pct": steal, "candidate": side(cpu_a), "baseline": side(cpu_b)}
    line = summary([sample(0.0, 1, 2), sample(4.0, 3, 3), sample(1.0, 5, 6), {"trial": 3}])
    assert line == "steal median 1.0% max 4.0%; busiest threads on one CPU in 1 of 3 samples"
    assert summary([]) == "steal not read; no thread samples"
    stolen = sample(0.0, 1, 2)
    stolen["baseline"]["busiest_cpu_steal_pct"] = 12.5
    assert summary([stolen]) == ("steal median 0.0% max 0.0%; their busiest threads' CPUs' steal max 12.5%; "
                                 "busiest threads on one CPU in 0 of 1 samples")


def test_a_sample_reads_as_one_line_per_process_and_the_hosts_steal():
    from bench.host_load import sample_line

    line = sample_line({"steal_pct": 1.5, "prefill": {"cpu_ms": 42.0, "busiest_thread_ms": 40.0,
                                                      "busiest_thread_cpu": 6, "threads_ran": 2}})
    assert line == "prefill 42 ms (busiest thread 40 on CPU 6, 2 threads ran); steal 1.5%"
    assert sample_line({}) == "not read"

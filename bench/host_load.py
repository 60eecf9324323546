"""What the host did to each server between two moments: the evidence for or against a neighbour.

On the H200 (2026-12-05) the A/B perf verdict's pairs were not independent: one server of a pair ran
10-25% slow for 5-10 pairs in a row, then recovered, so a clean build was called slower once and a 10%
slowdown went unseen once in 37 runs (docs/results.md, twenty-seventh session). A bench that sees
only the servers' figures cannot say why. This reads Linux's /proc around each pair:
- the host's CPU time stolen by other tenants (`steal`, a VM's hypervisor) and spent waiting on I/O, and
  the steal of the very CPU each server's busiest thread ran on (a neighbour may take one vCPU, not all);
- per server process: its CPU time, its busiest thread's CPU time and the CPU it last ran on, and
  how many of its threads ran at all;
so a slow stretch can be matched with a neighbour (steal), a shared core (two servers' busy threads
on one CPU) or the server's own work (its CPU time per token). Linux only; elsewhere every sample is
empty, and the bench runs as before.

    sampler = HostSampler({"baseline": pid_a, "candidate": pid_b}); ...; sampler.sample() -> dict
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
CPU_SYS = Path("/sys/devices/system/cpu")


def _ticks_per_s() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


def stat_times(proc: Path = PROC) -> tuple[dict[str, int] | None, dict[int, dict[str, int]]]:
    """One read of /proc/stat: the host's total, steal and iowait ticks since boot (its "cpu" line; None if
    unreadable) and each CPU's total and steal ticks (the "cpuN" lines)."""
    try:
        lines = (proc / "stat").read_text().splitlines()
    except OSError:
        return None, {}
    host, cpus = None, {}
    for line in lines:
        fields = line.split()
        if len(fields) < 9 or not fields[0].startswith("cpu"):
            continue
        values = [int(v) for v in fields[1:9]]
        if fields[0] == "cpu":
            host = {"total": sum(values), "iowait": values[4], "steal": values[7]}
        elif fields[0][3:].isdigit():
            cpus[int(fields[0][3:])] = {"total": sum(values), "steal": values[7]}
    return host, cpus


def thread_times(pid: int, proc: Path = PROC) -> dict[int, tuple[int, int]]:
    """Each thread of `pid`: (utime + stime ticks, the CPU it last ran on). Empty if it is gone."""
    out: dict[int, tuple[int, int]] = {}
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # a thread that ended between the listing and the read
        # The command name (field 2) may hold spaces and parentheses: split after its closing one.
        rest = stat[stat.rindex(")") + 2:].split()
        utime, stime, cpu = int(rest[11]), int(rest[12]), int(rest[36])
        out[int(task.name)] = (utime + stime, cpu)
    return out


def physical_cores(cpus: list[int], sys_cpu: Path = CPU_SYS) -> list[list[int]]:
    """`cpus` grouped by the physical core they share (SMT siblings together, by package then core id),
    in order of each core's first CPU. A CPU whose topology cannot be read is a core of its own."""
    cores: dict[tuple[int, int] | tuple[str, int], list[int]] = {}
    for cpu in sorted(cpus):
        topology = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            key: tuple[int, int] | tuple[str, int] = (int((topology / "physical_package_id").read_text()),
                                                      int((topology / "core_id").read_text()))
        except (OSError, ValueError):
            key = ("unknown", cpu)
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values(), key=lambda siblings: siblings[0])


class HostSampler:
    """Deltas since the previous `sample()` (the first one: since construction)."""

    def __init__(self, pids: dict[str, int], proc: Path = PROC) -> None:
        self.pids, self.proc = dict(pids), proc
        self.tick_ms = 1000 / _ticks_per_s()
        self._host, self._cpus = stat_times(proc)
        self._threads = {name: thread_times(pid, proc) for name, pid in self.pids.items()}

    def sample(self) -> dict:
        host, cpus = stat_times(self.proc)
        threads = {name: thread_times(pid, self.proc) for name, pid in self.pids.items()}
        out: dict = {}
        if host and self._host and host["total"] > self._host["total"]:
            total = host["total"] - self._host["total"]
            out["steal_pct"] = round(100 * (host["steal"] - self._host["steal"]) / total, 2)
            out["iowait_pct"] = round(100 * (host["iowait"] - self._host["iowait"]) / total, 2)
        for name, now in threads.items():
            before = self._threads.get(name, {})
            used = {tid: ticks - before.get(tid, (0, 0))[0] for tid, (ticks, _) in now.items()}
            if not used:
                continue
            busiest = max(used, key=used.__getitem__)
            out[name] = {"cpu_ms": round(sum(used.values()) * self.tick_ms, 1),
                         "busiest_thread_ms": round(used[busiest] * self.tick_ms, 1),
                         "busiest_thread_cpu": now[busiest][1],
                         "threads_ran": sum(1 for ticks in used.values() if ticks > 0)}
            cpu, cpu_before = cpus.get(now[busiest][1]), self._cpus.get(now[busiest][1])
            if cpu and cpu_before and cpu["total"] > cpu_before["total"]:
                out[name]["busiest_cpu_steal_pct"] = round(
                    100 * (cpu["steal"] - cpu_before["steal"]) / (cpu["total"] - cpu_before["total"]), 2)
        self._host, self._cpus, self._threads = host, cpus, threads
        return out


def sample_line(sample: dict) -> str:
    """One `HostSampler.sample()` in one line: per process its CPU time, its busiest thread's and the CPU that
    thread last ran on, then the host's steal."""
    parts = [f"{name} {load['cpu_ms']:.0f} ms (busiest thread {load['busiest_thread_ms']:.0f} on CPU "
             f"{load['busiest_thread_cpu']}, {load['threads_ran']} threads ran)"
             for name, load in sample.items() if isinstance(load, dict)]
    if "steal_pct" in sample:
        parts.append(f"steal {sample['steal_pct']}%")
    return "; ".join(parts) or "not read"


def summary(samples: list[dict], sides: tuple[str, str] = ("candidate", "baseline")) -> str:
    """One line over a run's samples: the host's steal (median, max), the largest steal of a CPU a side's
    busiest thread ran on, and in how many samples both sides' busiest threads last ran on one CPU (a
    shared core slows whichever server it lands on; under `--pin shared` that is by design)."""
    steal = sorted(s["steal_pct"] for s in samples if "steal_pct" in s)
    both = [s for s in samples if all(side in s for side in sides)]
    shared = sum(1 for s in both if s[sides[0]]["busiest_thread_cpu"] == s[sides[1]]["busiest_thread_cpu"])
    parts = [f"steal median {steal[len(steal) // 2]:.1f}% max {steal[-1]:.1f}%" if steal else "steal not read"]
    own = [s[side]["busiest_cpu_steal_pct"] for s in samples for side in sides
           if "busiest_cpu_steal_pct" in s.get(side, {})]
    if own:
        parts.append(f"their busiest threads' CPUs' steal max {max(own):.1f}%")
    parts.append(f"busiest threads on one CPU in {shared} of {len(both)} samples" if both else "no thread samples")
    return "; ".join(parts)


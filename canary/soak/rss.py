"""A process's resident memory over a run, read from /proc (no psutil), and the flatness check the
soak test gates on: after a warm-up, the high-water mark of the *sustained* RSS may not climb by
more than a bound.

Why the high-water mark: a server that reuses its memory reaches its level during warm-up (the
allocator's arenas, caches and batch-sized buffers fill up once) and stays under it afterwards; a
leak keeps pushing the level up. Why sustained (a rolling median over `window_s`): one large
prefill step allocates tens of MiB for a second or two and returns them; that is working memory,
not a leak, and a raw maximum would count it (the first 1,000-session soak failed on exactly one
such 2 s sample). Leaked memory never goes away, so it moves the median within half a window.
"""

from __future__ import annotations

import csv
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024


def read_rss_bytes(pid: int) -> int | None:
    """VmRSS of `pid` in bytes, or None once the process is gone (or is a zombie, which has no VmRSS)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    value, unit = line.split()[1:3]
                    assert unit == "kB", line  # the kernel always reports kB here
                    return int(value) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


@dataclass(frozen=True)
class RssSample:
    t_s: float  # seconds since sampling started
    rss_bytes: int
    progress: int  # work completed so far (the soak counts finished requests)


class RssSampler:
    """Samples a process's RSS together with the run's progress every `interval_s`, on a daemon
    thread, from `start()` (or `with`) until `stop()`; stops by itself when the process exits."""

    def __init__(self, pid: int, progress: Callable[[], int], interval_s: float = 2.0) -> None:
        self.pid = pid
        self.progress = progress
        self.interval_s = interval_s
        self.samples: list[RssSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rss-sampler-{pid}", daemon=True)
        self._t0 = 0.0

    def start(self) -> RssSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> list[RssSample]:
        self._stop.set()
        self._thread.join()
        self._sample()  # the end state, whatever the phase of the interval
        return self.samples

    def __enter__(self) -> RssSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        while self._sample() and not self._stop.wait(self.interval_s):
            pass

    def _sample(self) -> bool:
        rss = read_rss_bytes(self.pid)
        if rss is None:
            return False
        self.samples.append(RssSample(time.monotonic() - self._t0, rss, self.progress()))
        return True


def write_csv(path: Path, samples: list[RssSample]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "rss_bytes", "progress"])
        writer.writerows((f"{s.t_s:.3f}", s.rss_bytes, s.progress) for s in samples)
    return path


def sustained_levels(samples: list[RssSample], window_s: float) -> list[float]:
    """Trailing rolling median of RSS over the last `window_s` seconds at each sample: an excursion
    shorter than half the window does not move it."""
    levels, first = [], 0
    for i, sample in enumerate(samples):
        while samples[first].t_s <= sample.t_s - window_s:
            first += 1
        levels.append(statistics.median(s.rss_bytes for s in samples[first:i + 1]))
    return levels


@dataclass(frozen=True)
class Flatness:
    warmup_fraction: float
    warmup_progress: int  # progress at which the warm-up ended
    bound_bytes: int
    window_s: float  # of the rolling median that defines the sustained level
    start_bytes: int  # first sample
    warmup_level_bytes: float  # high-water mark of the sustained level during the warm-up: the reference
    level_bytes: float  # high-water mark of the sustained level after the warm-up
    raw_peak_bytes: int  # highest single sample after the warm-up (transients included), for the record
    end_bytes: int  # last sample

    @property
    def growth_bytes(self) -> float:
        return self.level_bytes - self.warmup_level_bytes

    @property
    def passed(self) -> bool:
        return self.growth_bytes < self.bound_bytes

    def describe(self) -> str:
        verdict = "flat" if self.passed else "NOT FLAT"
        return (f"[rss] {verdict}: start {self.start_bytes / MIB:.1f} MiB; sustained level ({self.window_s:.0f} s "
                f"rolling median) at most {self.warmup_level_bytes / MIB:.1f} MiB during the warm-up "
                f"({self.warmup_fraction:.0%} = {self.warmup_progress} done) and {self.level_bytes / MIB:.1f} MiB "
                f"after it: growth {self.growth_bytes / MIB:+.1f} MiB (bound < {self.bound_bytes / MIB:.0f} MiB); "
                f"highest single sample after warm-up {self.raw_peak_bytes / MIB:.1f} MiB; "
                f"end {self.end_bytes / MIB:.1f} MiB")

    def as_dict(self) -> dict:
        return {**self.__dict__, "growth_bytes": self.growth_bytes, "passed": self.passed}


def check_flat(samples: list[RssSample], bound_bytes: int, warmup_fraction: float = 0.2,
               window_s: float = 30.0) -> Flatness:
    """Warm-up = the samples taken before `warmup_fraction` of the final progress was reached."""
    if not samples:
        raise ValueError("no RSS samples: was the process alive during the run?")
    warmup_progress = warmup_fraction * samples[-1].progress
    levels = sustained_levels(samples, window_s)
    warm = [i for i, s in enumerate(samples) if s.progress < warmup_progress]
    after = [i for i, s in enumerate(samples) if s.progress >= warmup_progress]
    if not warm or len(after) < 2:
        # Too short a run (or one sample): flatness cannot be judged, and a check that cannot
        # fail must not pass silently.
        raise ValueError(f"cannot judge flatness: {len(warm)} warm-up and {len(after)} later samples")
    return Flatness(warmup_fraction, samples[after[0]].progress, bound_bytes, window_s, samples[0].rss_bytes,
                    max(levels[i] for i in warm), max(levels[i] for i in after),
                    max(samples[i].rss_bytes for i in after), samples[-1].rss_bytes)

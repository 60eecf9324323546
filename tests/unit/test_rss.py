"""The soak's memory probe: RSS read from /proc, the background sampler, the flatness check (with
its negative controls: growing series must fail, a transient spike must not) and the CSV/plot
outputs."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time

import pytest

from canary.reports import write_rss_plot
from canary.soak.rss import MIB, RssSample, RssSampler, check_flat, read_rss_bytes, sustained_levels, write_csv

pytestmark = pytest.mark.unit

BOUND = 64 * MIB


def series(rss_mib_of_progress, n: int = 500) -> list[RssSample]:
    """One sample per unit of progress, 2 s apart, RSS given as a function of progress (MiB)."""
    return [RssSample(2.0 * i, int(rss_mib_of_progress(i) * MIB), i) for i in range(n)]


def test_rss_of_this_process_agrees_with_statm():
    with open("/proc/self/statm") as f:
        statm_bytes = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    rss = read_rss_bytes(os.getpid())
    # Two reads of a live process a moment apart, from two kernel counters: close, not equal.
    assert rss is not None and abs(rss - statm_bytes) < 0.05 * statm_bytes + 4 * MIB


def test_rss_of_an_exited_process_is_none():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: /proc/<pid> is gone
    assert read_rss_bytes(child.pid) is None


def test_sampler_sees_memory_being_touched_and_records_progress():
    done = [0]
    with RssSampler(os.getpid(), progress=lambda: done[0], interval_s=0.02) as sampler:
        time.sleep(0.1)
        ballast = b"\x01" * (96 * MIB)  # written, so every page is resident
        done[0] = 1
        time.sleep(0.1)
    assert len(ballast) == 96 * MIB
    samples = sampler.samples
    before = [s.rss_bytes for s in samples if s.progress == 0]
    after = [s.rss_bytes for s in samples if s.progress == 1]
    assert before and after
    assert min(after) - min(before) > 80 * MIB
    assert [s.t_s for s in samples] == sorted(s.t_s for s in samples)


def test_sampler_stops_by_itself_when_the_process_exits():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    sampler = RssSampler(child.pid, progress=lambda: 0, interval_s=0.02).start()
    child.wait()
    sampler._thread.join(timeout=10)
    assert not sampler._thread.is_alive()
    assert sampler.samples, "sampled while the child was alive"
    assert len(sampler.stop()) == len(sampler.samples)  # nothing to add once the process is gone


def test_a_flat_jittering_series_passes():
    flat = check_flat(series(lambda i: 800 + (i * 7919 % 13)), BOUND)  # 0..12 MiB of jitter
    assert flat.passed and abs(flat.growth_bytes) <= 12 * MIB, flat.describe()


def test_a_transient_spike_is_working_memory_not_growth():
    # The first full soak's case: one 2 s sample +80 MiB (a large prefill step), gone at the next.
    flat = check_flat(series(lambda i: 550 + (80 if i == 300 else 0)), BOUND)
    assert flat.passed and flat.growth_bytes == 0, flat.describe()
    assert flat.raw_peak_bytes == 630 * MIB  # still on record
    # Five samples (10 s) high: less than half of the 30 s window, still transient.
    assert check_flat(series(lambda i: 550 + (80 if 300 <= i < 305 else 0)), BOUND).passed


def test_the_sustained_level_is_a_trailing_rolling_median():
    samples = series(lambda i: [500, 900, 500, 500, 700, 700, 700][i], n=7)
    assert [level / MIB for level in sustained_levels(samples, window_s=5.0)] == [500, 700, 500, 500, 500, 700, 700]


def test_growth_during_the_warm_up_is_not_counted():
    # Allocator arenas filling up: +200 MiB over the first 10% of the run, flat afterwards.
    flat = check_flat(series(lambda i: 600 + min(i, 50) * 4), BOUND, warmup_fraction=0.2)
    assert flat.passed, flat.describe()
    assert flat.start_bytes == 600 * MIB and flat.warmup_level_bytes == 800 * MIB


def test_a_steadily_growing_series_fails():
    # Negative control: a 20 KiB-per-request leak over 5,000 requests; the 4,000 after the warm-up
    # add 78 MiB (the bound catches any per-request leak above 64 MiB / 4,000 = 16 KiB here).
    leak = 20 * 1024
    samples = [RssSample(2.0 * i, 800 * MIB + leak * 10 * i, 10 * i) for i in range(500)]
    flat = check_flat(samples, BOUND)
    assert not flat.passed, flat.describe()
    assert "NOT FLAT" in flat.describe()
    assert flat.growth_bytes == leak * 10 * (499 - 99)


def test_a_late_step_just_over_the_bound_fails_and_just_under_passes():
    assert not check_flat(series(lambda i: 800 + (65 if i > 400 else 0)), BOUND).passed
    assert check_flat(series(lambda i: 800 + (63 if i > 400 else 0)), BOUND).passed


def test_too_few_samples_cannot_pass():
    with pytest.raises(ValueError):
        check_flat([], BOUND)
    with pytest.raises(ValueError):
        check_flat(series(lambda i: 800, n=1), BOUND)


def test_csv_and_plot(tmp_path):
    samples = series(lambda i: 800 + i * 0.01, n=50)
    path = write_csv(tmp_path / "rss.csv", samples)
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 50 and int(rows[7]["rss_bytes"]) == samples[7].rss_bytes and rows[7]["progress"] == "7"
    png = write_rss_plot(tmp_path, samples, check_flat(samples, BOUND))
    assert png.read_bytes().startswith(b"\x89PNG")

"""bench.kernels' sweep of the selection's passes over the row (`_bench_row_pass_launches`), on CPU through the
Triton interpreter with the CUDA-graph timer replaced: every launch is run and reported, the fastest of each pass
is chosen, and a launch that changes the output is reported as such (the sweep only runs on a GPU otherwise, where
a mistake costs a device call)."""

from __future__ import annotations

import itertools

import pytest
import torch

from bench import kernels as bench
from runtime.kernels.triton import topk

VARIANTS = ({"warps": 8}, {"warps": 2}, {"warps": 4, "stages": 1})


@pytest.fixture
def sweep(monkeypatch):
    """The sweep over small rows (2 x 128 positions, top-16, window 8, segments of 64), each graph_us call run
    once and timed by a clock that only goes down: the last launch timed of each pass is its fastest."""
    ticks = itertools.count()

    def fake_graph_us(fns, reps=None):
        for fn in fns:
            fn()
        return 1000.0 - next(ticks)

    monkeypatch.setattr(bench, "graph_us", fake_graph_us)
    monkeypatch.setattr(bench, "ROW_PASS_VARIANTS", VARIANTS)
    monkeypatch.setattr(bench, "SELECT_WINDOW", 8)
    scores = torch.randn(2, 128, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([127, 100])
    return lambda: bench._bench_row_pass_launches(scores, positions, 16, (4, 64))


def test_the_sweep_times_every_launch_and_keeps_the_fastest_of_each_pass(sweep):
    out = sweep()
    names = ["warps8", "warps2", "warps4/stages1"]
    for row_pass in topk.ROW_PASS_LAUNCHES:
        assert list(out[f"select_{row_pass}_launches_us"]) == names
    assert out["select_row_pass_best"] == {"maxima": VARIANTS[-1], "candidates": VARIANTS[-1]}
    assert out["select_row_pass_same"] is True
    assert set(out["select_row_pass_best_launch_us"]) == {"maxima", "bound", "candidates", "finish"}


def test_the_sweep_reports_a_launch_that_changes_the_output(sweep, monkeypatch):
    """Negative control: a candidates launch planted to drop a row's last chosen position must read as
    not the same."""
    real = topk.select_slots

    def planted(*args, row_pass_launches=None, **kwargs):
        sel, ok = real(*args, row_pass_launches=row_pass_launches, **kwargs)
        if (row_pass_launches or {}).get("candidates", {}).get("warps") == 2:
            sel = sel.clone()
            sel[0, -1] = -1
        return sel, ok

    monkeypatch.setattr(bench.triton_topk, "select_slots", planted)
    assert sweep()["select_row_pass_same"] is False

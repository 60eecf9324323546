"""bench.indexer_pages on CPU through the Triton interpreter, the CUDA-graph timer replaced: every row and every
launch variant is reported with its bits checked against the pointer kernel, and a variant planted to change a
logit reads as not the same (the bench only runs on a GPU otherwise, where a mistake costs a device call)."""

from __future__ import annotations

import inspect

import pytest
import torch

from bench import indexer_pages as bench
from runtime.kernels.triton import indexer_pages

PAGE = indexer_pages.TILE  # a page of one tile: the interpreter's smallest case


def _case():
    """bench.kernels._indexer_case's form, small: 2 rows of 8 pages, 4 heads of 16 lanes, keys with a scale."""
    gen = torch.Generator().manual_seed(0)
    pages, rows = 8, 2
    table = torch.stack([torch.randperm(pages * rows, generator=gen)[:pages] for _ in range(rows)]).to(torch.int32)
    lens = torch.tensor([pages * PAGE, pages * PAGE - 5], dtype=torch.int32)
    keys = torch.randn(pages * rows * PAGE, 16, generator=gen)
    scale = torch.rand(keys.shape[0], generator=gen) + 0.5
    q = torch.randn(rows, 4, 16, generator=gen)
    w = torch.rand(rows, 4, generator=gen)
    return table, lens, (lens - 1).long(), w, (("fp32", q, keys, scale, 16 * 4 + 4),)


@pytest.fixture
def run(monkeypatch):
    monkeypatch.setattr(bench, "graph_us", lambda fns, reps=None: [fn() for fn in fns] and 10.0)
    monkeypatch.setattr(bench, "SELECT_WINDOW", 4)
    monkeypatch.setattr(bench, "TOPK", 8)
    ceilings = {"read_bytes_per_s": 1e12, "bf16_flops_per_s": 1e15}
    return lambda batch, variants: bench.bench_batch(batch, _case(), ceilings, variants, page_size=PAGE)


def test_every_launch_is_reported_with_the_pointer_kernels_bits(run):
    row, = run(2, variants=True)
    assert row["same_bits"] is True and row["plus_select_same"] is True
    assert set(row["launches"]) == set(indexer_pages.LAUNCH_VARIANTS)
    assert all(v == dict(us=10.0, same_bits=True) for v in row["launches"].values()), row["launches"]
    assert row["pct_roofline_pages"] > 0 and row["context"] == 8 * PAGE
    one, = run(1, variants=False)
    assert one["B"] == 1 and one["same_bits"] is True and "launches" not in one


def test_a_launch_that_changes_a_logit_reads_as_not_the_same(run, monkeypatch):
    real = indexer_pages.page_logits
    signature = inspect.signature(real)

    def planted(*args, **kwargs):
        real(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments  # by name: the bench may pass them either way
        if given["tiles"] == 8:
            given["out"][0, 3] += 1.0
    monkeypatch.setattr(indexer_pages, "page_logits", planted)
    row, = run(2, variants=True)
    assert row["launches"]["tiles8"]["same_bits"] is False
    assert row["same_bits"] is True and row["launches"]["tiles32"]["same_bits"] is True

"""A prompt token's bits do not depend on the prefill chunk it lands in, at the DSV4-like slice's shapes.

The canary's engine test (test_engine_gpu.py::test_prompt_bits_do_not_depend_on_the_prefill_chunk) runs
shapes where no weight is split over K and no MoE bucket has launches of its own. The slice (hidden 4,096,
64 heads, 256 experts of I=256, bf16) takes every prefill-only path a 4,096-row pass takes: the TMA GEMM
with each tile's splits added in its program (`matmul.FUSED_TMA`), the MoE 4,096 bucket's fused gate/up and
walked down launches, the indexer's skipped blocks past each query's length, the two-pass sparse MLA. Its
rows here, cut into decode-sized chunks (split programs + `_split_sum_kernel`, the small MoE buckets, the
one-pass MLA) or into two uneven prefill chunks, must give the one pass's logits bit for bit.

Negative control: the same comparison on the slice built with cuBLAS GEMMs (`gemm="cublas"`, whose
kernel and split-K follow M) must find a difference."""

from __future__ import annotations

import pytest
import torch

from bench.decode_step import SLICE, Bench, random_weights
from runtime.graph.decode_model import DecodeInputs
from runtime.graph.runner import FINE_BUCKETS
from runtime.streams.cuda import CudaStreamExecutor

pytestmark = [pytest.mark.gpu]

PROMPT = 1100  # two requests of 1,100 tokens: one pass of 2,200 rows uses the MoE's 4,096 bucket
PAGES = 128  # per request: 2,048 positions of capacity


@pytest.fixture(scope="module")
def weights():
    return random_weights(SLICE, small=False)


def slice_model(weights, gemm: str) -> Bench:
    kernels = {"moe_kernel": "triton", "attention_kernel": "triton", "gemm": gemm}
    return Bench(SLICE, dict(weights), PAGES, 2, FINE_BUCKETS, CudaStreamExecutor(), kernels)


def rows(inp: DecodeInputs, start: int, end: int) -> DecodeInputs:
    return DecodeInputs(inp.token_ids[start:end], inp.positions[start:end], inp.write_slots[start:end],
                        inp.page_table[start:end])


def chunked_logits(bench: Bench, prompt: DecodeInputs, cuts: list[int]) -> torch.Tensor:
    """The prompt's rows through the model in passes ending at `cuts`, on a freshly scrambled cache: each
    pass reads only the KV that the passes before it (and its own rows) wrote."""
    bench.kv.latent.normal_()
    bench.kv.index_keys.normal_()
    out, start = [], 0
    for end in cuts:
        out.append(bench.runner.eager(rows(prompt, start, end)).clone())
        start = end
    return torch.cat(out)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    differ = (a != b).any(dim=1).nonzero()
    return "equal" if differ.numel() == 0 else f"{differ.numel()} of {a.shape[0]} rows differ, first {int(differ[0])}"


@pytest.mark.parametrize("cuts", [list(range(200, 2 * PROMPT, 200)) + [2 * PROMPT], [1500, 2 * PROMPT]],
                         ids=["decode-sized-chunks", "two-prefill-chunks"])
def test_slice_prompt_bits_do_not_depend_on_the_chunk(weights, cuts):
    bench = slice_model(weights, "invariant")
    prompt = bench.prefill(2 * PROMPT, PROMPT)
    whole = chunked_logits(bench, prompt, [2 * PROMPT])
    assert not torch.isnan(whole).any()
    chunked = chunked_logits(bench, prompt, cuts)
    assert torch.equal(whole, chunked), first_difference(whole, chunked)


def test_control_cublas_gemms_make_the_bits_follow_the_chunk(weights):
    bench = slice_model(weights, "cublas")
    prompt = bench.prefill(2 * PROMPT, PROMPT)
    whole = chunked_logits(bench, prompt, [2 * PROMPT])
    chunked = chunked_logits(bench, prompt, list(range(200, 2 * PROMPT, 200)) + [2 * PROMPT])
    assert not torch.equal(whole, chunked), "an M-dependent GEMM gave the same bits: the check is blind"

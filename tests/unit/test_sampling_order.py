"""Issue 18, item 5: seeded sampling follows vLLM's and SGLang's order - temperature, then top-k,
then top-p, then one draw from the request's own generator - checked bit for bit against a readable
reference sampler with the same generator, and statistically on the distribution. The oracle fails
on the swapped order (top-k/top-p on the untempered distribution, temperature afterwards)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.engine.request import Request, SamplingParams
from runtime.engine.sampler import sample_row
from tests.utils import sampled_rows

pytestmark = pytest.mark.unit

V = 64


def reference_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                     tempered_first: bool = True) -> int:
    """Readable float64 reference. `tempered_first=False` is the planted bug."""
    logits = logits.double()
    probs = torch.softmax(logits / params.temperature if tempered_first else logits, dim=-1)
    order = sorted(range(V), key=lambda i: (-float(probs[i]), i))
    kept = order[: params.top_k] if params.top_k else order
    mass, nucleus = 0.0, []
    for i in kept:  # the smallest prefix whose mass reaches top_p
        if mass >= params.top_p:
            break
        nucleus.append(i)
        mass += float(probs[i])
    weights = torch.softmax(logits[nucleus] / params.temperature, dim=-1) if not tempered_first else \
        probs[nucleus] / probs[nucleus].sum()
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    cdf = 0.0
    for i, w in zip(nucleus, weights.tolist()):
        cdf += w
        if u < cdf:
            return i
    return nucleus[-1]


CASES = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=s)
         for t, p, k, s in [(0.5, 0.9, 0, 1), (2.0, 0.5, 0, 2), (0.7, 1.0, 5, 3), (1.3, 0.8, 10, 4), (0.3, 0.95, 3, 5)]]


def draws(params: SamplingParams, n: int, tempered_first: bool = True) -> tuple[list[int], list[int]]:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(params.seed)) * 3
    req = Request("r", [0], params)
    ref_gen = torch.Generator().manual_seed(params.seed)
    ours = [sample_row(logits, req).token for _ in range(n)]
    theirs = [reference_sample(logits, params, ref_gen, tempered_first) for _ in range(n)]
    return ours, theirs


@pytest.mark.parametrize("params", CASES, ids=str)
def test_seeded_sampling_equals_the_reference_bit_for_bit(params):
    ours, theirs = draws(params, 300)
    assert ours == theirs


def test_negative_control_swapped_order_is_caught():
    assert any(ours != theirs for ours, theirs in (draws(p, 300, tempered_first=False) for p in CASES))


def test_distribution_matches_tempered_nucleus():
    """2,000 draws against the tempered, truncated distribution (chi-square, far from the bound)."""
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=8, seed=11)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(11)) * 2
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)[: params.top_k]
    before = torch.cumsum(probs[order], 0) - probs[order]
    nucleus = order[before < params.top_p]
    expected = probs[nucleus] / probs[nucleus].sum()
    req = Request("r", [0], params)
    n = 2000
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(n):
        counts[sample_row(logits, req).token] += 1
    assert counts.sum() == counts[nucleus].sum()  # never outside the nucleus
    chi2 = float((((counts[nucleus] - n * expected) ** 2) / (n * expected)).sum())
    assert chi2 < 40  # df <= 7: p < 1e-5 for a correct sampler to exceed this


def test_forced_opening_then_free_sampling():
    params = SamplingParams(temperature=0.0, forced_ids=(5, 6, 7))
    logits = torch.zeros(V)
    logits[9] = 5.0
    req = Request("r", [0], params)
    assert [sample_row(logits, req).token for _ in range(5)] == [5, 6, 7, 9, 9]


def test_device_sampler_draws_each_row_from_its_own_generator():
    """The batched path the engine runs (sample_on_device, here on CPU): greedy rows take the first
    maximum, sampled rows equal the reference with each request's own seed, whatever their
    neighbours; a batch-wide generator or the swapped order would differ."""
    from runtime.engine.device_sampler import sample_on_device

    params = [SamplingParams(temperature=0.0), CASES[0], SamplingParams(temperature=0.0), CASES[3], CASES[1]]
    logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(7)) * 3
    requests = [Request(f"r{i}", [0], p) for i, p in enumerate(params)]
    generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    for _ in range(100):
        tokens, outputs = sample_on_device(logits.clone(), requests)
        for i, (p, gen) in enumerate(zip(params, generators)):
            expected = int(torch.argmax(logits[i])) if gen is None else reference_sample(logits[i], p, gen)
            assert int(tokens[i]) == outputs[f"r{i}"].token == expected, f"row {i}"


def test_device_sampler_writes_forced_openings_of_greedy_rows():
    """The batched path's forced tokens (one write for the step, not one per row): each greedy row
    with a constrained opening takes its forced ids, then its argmax; its neighbours (plain greedy, and
    a sampled row whose opening sample_row forces) are untouched. The forced ids are never the argmax,
    so a write that missed a row or landed on another one fails."""
    from runtime.engine.device_sampler import sample_on_device

    params = [SamplingParams(temperature=0.0, forced_ids=(5, 6)), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, forced_ids=(11,)),
              SamplingParams(temperature=0.8, seed=3, forced_ids=(13,))]
    logits = torch.full((len(params), V), -2.0)
    logits[:, 9] = 5.0  # every row's argmax
    requests = [Request(f"r{i}", [0], p) for i, p in enumerate(params)]
    steps = [[int(t) for t in sample_on_device(logits.clone(), requests)[0]] for _ in range(3)]
    assert [row[0] for row in steps] == [5, 6, 9], "a forced greedy row"
    assert [row[1] for row in steps] == [9, 9, 9], "a plain greedy row"
    assert [row[2] for row in steps] == [11, 9, 9], "a forced greedy row beside another"
    assert steps[0][3] == 13, "a sampled row's forced opening"


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 12), vocab=st.sampled_from([7, 64, 1000]))
def test_device_draw_equals_sample_row_bit_for_bit_on_cpu(seed, n, vocab):
    """The batched draw the GPU runs (`draw_rows` through sample_on_device, here on CPU) against
    `sample_row` per row with a copy of each request's generator: the same tokens, step after step."""
    from runtime.engine.device_sampler import sample_on_device

    logits, params = sampled_rows(seed, n, vocab)
    batched = [Request(f"r{i}", [0], p) for i, p in enumerate(params)]
    solo = [Request(f"r{i}", [0], p) for i, p in enumerate(params)]
    for _ in range(3):
        tokens = sample_on_device(logits.clone(), batched)[0].tolist()
        assert tokens == [sample_row(logits[i], req).token for i, req in enumerate(solo)]


def test_negative_control_a_uniform_drawn_for_another_row_is_caught(monkeypatch):
    """The oracle above fails when each row's draw uses its neighbour's uniform."""
    from runtime.engine import device_sampler, sampler

    def shifted(logits, temperature, top_k, top_p, uniform):
        return sampler.draw_rows(logits, temperature, top_k, top_p, uniform.roll(1))

    monkeypatch.setattr(device_sampler, "draw_rows", shifted)
    logits, params = sampled_rows(5, 8, 64)
    batched = [Request(f"r{i}", [0], p) for i, p in enumerate(params)]
    solo = [Request(f"r{i}", [0], p) for i, p in enumerate(params)]
    caught = False
    for _ in range(5):
        tokens = device_sampler.sample_on_device(logits.clone(), batched)[0].tolist()
        caught |= tokens != [sample_row(logits[i], req).token for i, req in enumerate(solo)]
    assert caught

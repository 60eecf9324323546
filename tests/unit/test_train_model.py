"""The training forward computes the served function: logits match the engine's model on the same
weights (sparse mode, contexts longer than window + topk), and the selection rule matches the
CPU kernel's bit for bit."""

from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig, ModelConfig
from runtime.kernels import cpu
from runtime.kvcache.kv_cache import KVCache
from runtime.models.batch import ForwardBatch, Segment
from runtime.models.dsv4_mini import DSV4Mini
from runtime.models.weights import init_random
from runtime.streams.tasks import InOrderExecutor
from runtime.train.model import TrainModel, selection

pytestmark = pytest.mark.unit

CFG = ModelConfig(vocab_size=96, hidden_size=48, num_layers=2, num_heads=3, kv_latent_dim=16, rope_dim=8,
                  index_heads=2, index_dim=12, index_topk=6, sliding_window=5, n_routed_experts=6,
                  num_experts_per_tok=2, moe_intermediate_size=24, n_group=2, topk_group=1,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2)


def engine_logits(weights, ids: list[int], upto: list[int]) -> torch.Tensor:
    """Last-token logits of the inference model for each prefix ids[:n], one prefill each."""
    model = DSV4Mini(CFG, weights, cpu)
    rows = []
    for n in upto:
        kv = KVCache(CFG, EngineConfig(page_size=16, num_pages=8), torch.float32)
        slots = torch.arange(n)
        batch = ForwardBatch(torch.tensor(ids[:n]), torch.arange(n), slots, (Segment(0, n, slots),))
        rows.append(model.forward(batch, kv, InOrderExecutor())[0])
    return torch.stack(rows)


def test_training_forward_matches_engine_prefill():
    weights = init_random(CFG, seed=5)
    ids = torch.randint(3, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    upto = [4, 11, 12, 25, 40]  # inside the window, at the edge, and well past window + topk
    model = TrainModel(CFG, weights)
    with torch.no_grad():
        out = model(torch.tensor([ids]), torch.ones(1, 40), sparse=True)
    train = out.logits[0, [n - 1 for n in upto]]
    served = engine_logits(weights, ids, upto)
    torch.testing.assert_close(train, served, rtol=1e-4, atol=1e-4)
    # Negative control: dense attention is a different function once the context exceeds the selection.
    with torch.no_grad():
        dense = model(torch.tensor([ids]), torch.ones(1, 40), sparse=False).logits[0, 39]
    assert (dense - served[-1]).abs().max() > 1e-3


def test_selection_matches_cpu_kernel_including_ties():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 3, (2, 30, 30), generator=gen).float()  # many exact ties
    ours = selection(scores, window=4, topk=5)
    for b in range(2):
        theirs = cpu.selection_mask(scores[b], torch.arange(30), 4, 5)
        assert torch.equal(ours[b], theirs)


def test_checkpoint_round_trips_in_inference_layout():
    weights = init_random(CFG, seed=2)
    state = TrainModel(CFG, weights).state()
    assert set(state) == set(weights)
    assert all(torch.equal(state[k], weights[k]) for k in weights)

"""CPU fast path: vectorized torch, float32, and batch-invariant by construction.

Batch invariance (a row's result never depends on which rows share the batch) is what makes
batched-vs-solo, eager-vs-graph and concurrent-vs-alone comparisons exact. BLAS picks different
blocking for different row counts, so a plain `x @ w.T` changes a row's last bits when the batch
grows. Here every matmul runs on fixed-size row tiles, so each row always goes through a call of
the same shape.

Segment invariance is the same property along the sequence: a row's bits never depend on which
segment of its request computed it (a prompt prefilled in one extend or in several, a preemption
recompute, a prefix-cache hit that starts the prefill mid-prompt). So no reduction may run over
"the segment's context": each indexer score is one element of a matmul of one fixed shape (row
and key tiles), and attention runs over a fixed width of gathered positions (window + top-k),
never over the context length with later positions masked (whose padding moved the softmax sum's
and probs @ latent's last bits with the segment's end). Shapes as in reference.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from runtime.kernels.types import MoEWeights

# Rows per matmul call. Every call has exactly this many rows (the last tile is zero-padded).
ROW_TILE = 32
# Transcendental elementwise ops (exp, silu, softplus, cos) take a SIMD path for whole vectors and a
# scalar path for the tail, and the two can differ in the last bit. Padding every row to a multiple
# of this many elements (two AVX-512 vectors) keeps each row entirely on the vector path.
ROW_ALIGN = 64
# torch splits elementwise work across threads above this many elements, at unaligned offsets.
SERIAL_ELEMENTS = 32768


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """Apply an elementwise `fn` so each row's result is independent of the other rows."""
    width = x.shape[-1]
    if x.numel() == 0:
        return fn(x)
    rows = x.reshape(-1, width)
    padded = -(-width // ROW_ALIGN) * ROW_ALIGN
    if padded != width:
        rows = F.pad(rows, (0, padded - width))
    per_call = max(1, SERIAL_ELEMENTS // padded)
    out = torch.cat([fn(rows[s:s + per_call]) for s in range(0, rows.shape[0], per_call)])
    return out[:, :width].reshape(x.shape)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [T, IN], weight: [OUT, IN] -> [T, OUT]
    rows = x.shape[0]
    padded = -(-rows // ROW_TILE) * ROW_TILE
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    out = x.new_empty(padded, weight.shape[0])
    weight_t = weight.t()
    for start in range(0, padded, ROW_TILE):
        torch.mm(x[start:start + ROW_TILE], weight_t, out=out[start:start + ROW_TILE])
    return out[:rows]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight


@functools.lru_cache(maxsize=16)
def _rope_table(half: int, theta: float, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions [0, length): computed once per shape, rows independent of `length`."""
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / (2 * half))
    # Angles in float64: large positions keep their phase accuracy.
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return rowwise(torch.cos, angles).to(dtype), rowwise(torch.sin, angles).to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    half = x.shape[-1] // 2
    longest = int(positions.max()) + 1 if positions.numel() else 1
    length = 1 << max(10, (longest - 1).bit_length())  # grow in powers of two: few tables
    cos_table, sin_table = _rope_table(half, float(theta), length, x.dtype)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos_table[positions].view(shape), sin_table[positions].view(shape)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# Indexer tiles: every score is one element of an [INDEX_ROW_TILE * HI, DI] @ [DI, KEY_TILE] matmul
# whose keys start at a multiple of KEY_TILE, whatever the segment (the last tiles zero-padded).
INDEX_ROW_TILE = 8
KEY_TILE = 256


def indexer_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    # q: [T, HI, DI], head_weights: [T, HI], keys: [L, DI], positions: [T] -> [T, L]
    """score[i, t] = sum_h w[i, h] * relu(q[i, h] . k[t]) for t <= positions[i]; later columns are 0
    (never read: selection ranks only positions <= p - window). Tiled so each score's bits depend on
    its query and key only: one fixed-shape matmul call per (row tile, key tile), the head sum
    elementwise in head order (a reduction kernel could pick its order by the tensor's shape)."""
    num_queries, heads, dim = q.shape
    length = keys.shape[0]
    rows = -(-num_queries // INDEX_ROW_TILE) * INDEX_ROW_TILE
    cols = -(-length // KEY_TILE) * KEY_TILE
    # Fresh padded buffers: every tile starts at the same alignment, whatever slice the caller passed.
    q_tiles = q.new_zeros(rows, heads, dim)
    q_tiles[:num_queries] = q
    w_tiles = head_weights.new_zeros(rows, heads)
    w_tiles[:num_queries] = head_weights
    key_tiles = keys.new_zeros(cols, dim)
    key_tiles[:length] = keys
    out = q.new_zeros(rows, cols)
    for r in range(0, num_queries, INDEX_ROW_TILE):
        q_rows = q_tiles[r:r + INDEX_ROW_TILE].view(INDEX_ROW_TILE * heads, dim)
        w_rows = w_tiles[r:r + INDEX_ROW_TILE]
        needed = int(positions[r:r + INDEX_ROW_TILE].max()) + 1
        for c in range(0, needed, KEY_TILE):
            per_head = torch.relu(torch.mm(q_rows, key_tiles[c:c + KEY_TILE].t())).view(INDEX_ROW_TILE, heads, KEY_TILE)
            score = per_head[:, 0] * w_rows[:, 0:1]
            for h in range(1, heads):
                score = score + per_head[:, h] * w_rows[:, h:h + 1]
            out[r:r + INDEX_ROW_TILE, c:c + KEY_TILE] = score
    return out[:num_queries, :length]


def selection_mask(scores: torch.Tensor, positions: torch.Tensor, window: int, topk: int) -> torch.Tensor:
    """Boolean [T, L] mask of the tokens each query attends to (see reference.select_tokens).

    Ties go to the earlier position. Instead of a full stable sort (O(L log L) per query, the
    hottest op of a CPU prefill), take the exact k-th largest score with topk, keep everything
    above it, and fill the remaining quota with the earliest candidates equal to it: the same set
    a stable descending sort would pick, bit for bit."""
    num_queries, length = scores.shape
    cols = torch.arange(length)[None, :]
    pos = positions[:, None]
    in_window = (cols <= pos) & (cols > pos - window)
    candidate = cols <= pos - window
    if topk == 0 or length == 0:
        return in_window
    ranked = torch.where(candidate, scores, torch.full_like(scores, float("-inf")))
    kth = torch.topk(ranked, min(topk, length), dim=-1).values[:, -1:]  # [T, 1]
    above = candidate & (ranked > kth)
    quota = topk - above.sum(-1, keepdim=True)
    tied = candidate & (ranked == kth)
    earliest_tied = tied & (torch.cumsum(tied, dim=-1) <= quota)
    return in_window | above | earliest_tied


def gathered_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, latent_dim: int,
                       scale: float) -> torch.Tensor:
    # q: [T, H, C+R], kv: [T, W, C+R] each row's selected positions gathered (W = window + top-k),
    # valid: [T, W] -> [T, H, C]
    """Latent MQA over gathered positions: softmax and probs @ latent reduce over the fixed width W
    (invalid columns at -inf), in batched matmuls of ROW_TILE rows, so a row's bits depend only on
    its query and its selected KV, never on its batch or segment."""
    num_rows = q.shape[0]
    padded = -(-num_rows // ROW_TILE) * ROW_TILE
    out = q.new_empty(padded, q.shape[1], latent_dim)
    if padded != num_rows:  # padded rows are all invalid: NaN rows, cut off below
        q = torch.cat([q, q.new_zeros(padded - num_rows, *q.shape[1:])])
        kv = torch.cat([kv, kv.new_zeros(padded - num_rows, *kv.shape[1:])])
        valid = torch.cat([valid, valid.new_zeros(padded - num_rows, valid.shape[1])])
    for r in range(0, padded, ROW_TILE):
        rows_kv = kv[r:r + ROW_TILE]
        scores = torch.bmm(q[r:r + ROW_TILE], rows_kv.transpose(1, 2)) * scale  # [ROW_TILE, H, W]
        scores = scores.masked_fill(~valid[r:r + ROW_TILE, None, :], float("-inf"))
        torch.bmm(torch.softmax(scores, dim=-1), rows_kv[:, :, :latent_dim], out=out[r:r + ROW_TILE])
    return out[:num_rows]


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
          scaling: float, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    affinity = rowwise(lambda t: torch.sqrt(F.softplus(t)), logits.float())
    return select_experts(affinity, bias, top_k, n_group, topk_group, scaling, normalize)


def select_experts(affinity: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                   scaling: float, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc on precomputed affinities [T, E]: group-limited, bias-corrected choice, weights from
    the unbiased affinity; ties to the lower id. Device-agnostic, no host syncs (the GPU path shares it)."""
    choice = affinity + bias.float()
    num_tokens, num_experts = affinity.shape
    if n_group > 1:
        grouped = choice.view(num_tokens, n_group, -1)
        best_two = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
        group_order = torch.sort(best_two, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        allowed = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=affinity.device)
        allowed.scatter_(1, group_order, True)
        allowed = allowed[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~allowed, float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = affinity.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scaling, ids


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return linear(rowwise(F.silu, linear(x, w_gate)) * linear(x, w_up), w_down)


def moe(x: torch.Tensor, weights: MoEWeights, *, top_k: int, n_group: int, topk_group: int,
        scaling: float, normalize: bool) -> torch.Tensor:
    route_w, route_ids = route(linear(x, weights.router), weights.bias, top_k, n_group, topk_group,
                               scaling, normalize)
    num_tokens = x.shape[0]
    per_slot = x.new_zeros(num_tokens, top_k, x.shape[1])  # [T, K, D] expert outputs by rank
    for expert in torch.unique(route_ids).tolist():
        token_idx, slot_idx = torch.nonzero(route_ids == expert, as_tuple=True)
        y = swiglu(x[token_idx], weights.w_gate[expert], weights.w_up[expert], weights.w_down[expert])
        per_slot[token_idx, slot_idx] = y
    # Combine in rank order with elementwise ops, so a token's sum never depends on its neighbours.
    out = x.new_zeros(x.shape)
    for slot in range(top_k):
        out = out + route_w[:, slot:slot + 1].to(x.dtype) * per_slot[:, slot]
    if weights.shared_gate is not None:
        assert weights.shared_up is not None and weights.shared_down is not None
        out = out + swiglu(x, weights.shared_gate, weights.shared_up, weights.shared_down)
    return out

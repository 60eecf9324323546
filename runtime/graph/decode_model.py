"""`StaticDecodeModel`: the dsv4-mini decode step with static shapes and no host syncs, so it can
be captured into a CUDA graph; same math as models/dsv4_mini.py (one new token per request).

The indexer runs on the "indexer" side stream through the declared-stream API and writes its
selection into persistent workspace buffers (as a captured graph's buffers are); attention joins
the stream before reading them. The `stream-race` fault drops that join.

A forward is one pass over all its rows: every op runs once over the whole (bucket-padded) batch,
so each weight is read once per step, and a row's bits do not depend on the batch because every op
is batch-invariant on its own (kernels/cuda_torch.py, kernels/triton/). Rows are tokens, not
requests: a prefill chunk is many rows of one or more requests at consecutive positions, each with
its request's page table. It is causal as it stands: each layer writes every row's KV before any
row's attention or indexer reads the cache, and a row only reads positions <= its own.
B = rows, L = context capacity (pages per request * page size), S = window + topk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.config import ModelConfig
from runtime.faults import NO_FAULTS, FaultSet
from runtime.kernels import cuda_torch as k
from runtime.kvcache.kv_cache import KVCache
from runtime.streams.tasks import MAIN, StreamExecutor, Task

INDEXER_STREAM = "indexer"


@dataclass(frozen=True)
class DecodeInputs:
    """One new token per request; its context is positions 0..position (page_table: [N, P])."""

    token_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    write_slots: torch.Tensor  # [N] long, where the new token's KV goes
    page_table: torch.Tensor  # [N, P] long, unused entries point at any valid page

    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]


class StaticDecodeModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, page_size: int, max_pages: int,
                 max_batch: int, faults: FaultSet = NO_FAULTS,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 moe_kernel: str = "torch", attention_kernel: str = "torch", gemm: str = "invariant") -> None:
        # The model takes ownership of `weights`: entries it repacks (stacked projections, kernel-layout
        # experts) become views into the packed copies, so no second copy outlives construction
        # when the caller keeps the dict (as benchmarks and tests do).
        self.cfg, self.w, self.faults = cfg, weights, faults
        # "cublas": torch.mm, not batch-invariant; only for measuring what the invariance rule costs.
        if gemm not in ("invariant", "cublas"):
            raise ValueError(f"gemm must be invariant or cublas, got {gemm!r}")
        self.linear = k.cublas_linear if gemm == "cublas" else k.linear
        for name, choice in (("moe_kernel", moe_kernel), ("attention_kernel", attention_kernel)):
            if choice not in ("torch", "triton"):
                raise ValueError(f"{name} must be torch or triton, got {choice!r}")
        # "triton": runtime/kernels/triton/moe.py's fused MoE (routed + shared expert in one combine,
        # float32 accumulation); "torch": the gathered-expert torch ops. Different numerics, so a
        # golden store belongs to one of them.
        self.fused_moe, self.packed_moe = None, []
        if moe_kernel == "triton":
            from runtime.kernels.triton import moe as triton_moe

            self.fused_moe = triton_moe.fused_moe
            shared = cfg.n_shared_experts > 0
            for layer in range(cfg.num_layers):
                p = f"layers.{layer}.moe."
                packed = triton_moe.pack_weights(
                    weights[p + "experts.w_gate"], weights[p + "experts.w_up"], weights[p + "experts.w_down"],
                    *((weights[p + "shared.w_gate"], weights[p + "shared.w_up"], weights[p + "shared.w_down"])
                      if shared else ()))
                self.packed_moe.append(packed)
                inter = weights[p + "experts.w_gate"].shape[1]
                weights[p + "experts.w_gate"], weights[p + "experts.w_up"] = packed.w13.split(inter, dim=1)
                weights[p + "experts.w_down"] = packed.w2
                if packed.shared_w13 is not None and packed.shared_w2 is not None:
                    shared_inter = weights[p + "shared.w_gate"].shape[0]
                    weights[p + "shared.w_gate"], weights[p + "shared.w_up"] = packed.shared_w13[0].split(shared_inter)
                    weights[p + "shared.w_down"] = packed.shared_w2[0]
        # "triton": the paged indexer-logits kernel and the split sparse MLA decode kernel. The split
        # count is fixed here, per deployment, never per batch: a row's bits must not depend on it.
        self.indexer_selection = self.sparse_mla = None
        if attention_kernel == "triton":
            from runtime.kernels.triton import attention as triton_attention
            from runtime.kernels.triton import indexer as triton_indexer
            from runtime.kernels.triton import mla_prefill

            self.indexer_selection = triton_indexer.logits_and_selection
            self.sparse_mla = mla_prefill.sparse_mla  # the one-pass kernel, or two passes for prefill chunks
            local_heads = weights["layers.0.attn.wq.weight"].shape[0] // (cfg.kv_latent_dim + cfg.rope_dim)
            self.attention_splits = triton_attention.default_num_splits(cfg.sliding_window + cfg.index_topk,
                                                                        local_heads)
        # Tensor parallel (runtime/distributed/sharding.py): this rank holds a share of the query
        # heads and of every expert's intermediate; attention and MoE outputs are partial sums.
        self.all_reduce = all_reduce or (lambda t: t)
        self.page_size, self.max_pages = page_size, max_pages
        embed = weights["embed.weight"]
        self.device, self.dtype = embed.device, embed.dtype
        self.lm_head = embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.cos, self.sin = k.rope_table(cfg.rope_dim // 2, cfg.rope_theta, page_size * max_pages,
                                          self.device, self.dtype)
        self._pack_projections(weights)
        S = cfg.sliding_window + cfg.index_topk
        # Workspace shared between streams; persistent so a graph captures fixed addresses.
        self.max_rows = max_batch
        self.hidden = torch.zeros(max_batch, cfg.hidden_size, dtype=self.dtype, device=self.device)
        self.sel_pos = torch.zeros(max_batch, S, dtype=torch.long, device=self.device)
        self.sel_ok = torch.zeros(max_batch, S, dtype=torch.bool, device=self.device)

    def _pack_projections(self, weights: dict[str, torch.Tensor]) -> None:
        """Projections that read the same input become one GEMM over their stacked weights, so a step
        launches one kernel (and reads the input once) instead of two or three: the query and the
        latent+rope key of attention, and the indexer's query, key and head weights. The stacked
        copy is the only one left: the weights' entries become views into it."""
        self.attn_proj, self.indexer_proj = [], []
        for layer in range(self.cfg.num_layers):
            for names, packed in ((("attn.wq", "attn.wkv"), self.attn_proj),
                                  (("indexer.wq", "indexer.wk", "indexer.weights_proj"), self.indexer_proj)):
                keys = [f"layers.{layer}.{name}.weight" for name in names]
                stacked = torch.cat([weights[key] for key in keys])
                start = 0
                for key in keys:
                    self.w[key] = stacked[start:start + weights[key].shape[0]]
                    start += weights[key].shape[0]
                packed.append(stacked)

    def _next_norm(self, layer: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The norm after layer's MoE and where its output goes: the next layer's attention norm
        into the indexer's `hidden` workspace, or the final norm (a new tensor)."""
        if layer + 1 < self.cfg.num_layers:
            return self.w[f"layers.{layer + 1}.attn_norm.weight"], self.hidden[rows]
        return self.w["norm.weight"], None

    @torch.inference_mode()
    def forward(self, inp: DecodeInputs, kv: KVCache, streams: StreamExecutor) -> torch.Tensor:
        """Writes each token's KV; returns float32 logits [N, V], in one pass over the N rows."""
        n = inp.batch_size
        assert 0 < n <= self.max_rows, f"{n} rows, workspace holds {self.max_rows}"
        assert inp.page_table.shape[1] == self.max_pages, "page table width is fixed at construction"
        cfg, eps, rows = self.cfg, self.cfg.rms_norm_eps, slice(0, n)
        pos, write, pages = inp.positions, inp.write_slots, inp.page_table  # [B], [B], [B, P]
        # Every context slot of every row [B, L]: only the torch attention and indexer gather by it.
        ctx = k.context_slots(pages, self.page_size) if self.sparse_mla is None else None
        # The indexer kernel's int32 page table and key counts: converted once per step, not per layer.
        paged = (pages.to(torch.int32), (pos + 1).to(torch.int32)) if self.indexer_selection is not None else None
        # Each residual add is fused into the norm that follows it (k.add_rms_norm), the embedding
        # gather into the first; an attention norm writes its rows into `hidden`, which the indexer
        # reads on its stream.
        x, _ = k.embed_rms_norm(inp.token_ids, self.w["embed.weight"], self.w["layers.0.attn_norm.weight"], eps,
                                out=self.hidden[rows])
        for layer in range(cfg.num_layers):
            delta = self._attention(layer, rows, self.hidden[rows], pos, write, ctx, pages, paged, kv, streams)
            x, h = k.add_rms_norm(x, delta, self.w[f"layers.{layer}.ffn_norm.weight"], eps)
            norm, into = self._next_norm(layer, rows)
            x, h = k.add_rms_norm(x, self._moe(layer, h), norm, eps, out=into)
        logits = self.linear(h, self.lm_head).float()
        streams.synchronize()
        return logits

    def _attention(self, layer: int, rows: slice, h: torch.Tensor, pos: torch.Tensor, write: torch.Tensor,
                   ctx: torch.Tensor | None, pages: torch.Tensor, paged: tuple[torch.Tensor, torch.Tensor] | None,
                   kv: KVCache, streams: StreamExecutor) -> torch.Tensor:
        """h: the normed rows (already in `hidden`). Writes the rows' latent cache, returns the
        attention output [B, D]."""
        cfg, w, p = self.cfg, self.w, f"layers.{layer}."
        C, R, B = cfg.kv_latent_dim, cfg.rope_dim, h.shape[0]

        streams.fork(INDEXER_STREAM)
        streams.submit(Task(f"indexer.{layer}", INDEXER_STREAM, reads=("hidden", "index_cache"),
                            writes=("index_cache", "selection"),
                            fn=lambda: self._indexer(layer, rows, pos, write, ctx, paged, kv)))

        proj = self.linear(h, self.attn_proj[layer])  # [B, H * (C + R) + C + R]: queries, then latent + rope key
        heads_width = proj.shape[1] - (C + R)
        q = proj[:, :heads_width].view(B, -1, C + R)
        # RoPE in place on the rope slice: a torch.cat of the whole [B, H, C + R] query (and of the
        # cache row) was 5% of a 4,096-row prefill pass. Same values, so the same bits.
        k.rope_(q[..., C:], pos, self.cos, self.sin)
        # The cache row: RMSNorm of the latent, RoPE of the key, stored at the row's slot (one kernel on a GPU).
        k.write_cache_rows(proj[:, heads_width:], pos, write, self.cos, self.sin, kv.latent[layer], R,
                           w[p + "attn.kv_norm.weight"], cfg.rms_norm_eps)
        out = torch.empty(B, q.shape[1], C, dtype=self.dtype, device=self.device)

        def attend() -> None:
            ok = self.sel_ok[rows]
            if self.sparse_mla is not None:
                slots = k.selected_slots(pages, self.sel_pos[rows], ok, self.page_size)
                self.sparse_mla(q, kv.latent[layer], slots, C, cfg.softmax_scale, num_splits=self.attention_splits,
                                out=out)
                return
            assert ctx is not None
            gathered = kv.latent[layer][ctx.gather(1, self.sel_pos[rows])]  # [B, S, C+R]
            # Unselected entries may be never-written (NaN-poisoned) slots: zero them, as 0 * NaN = NaN.
            gathered = torch.where(ok[..., None], gathered, torch.zeros((), dtype=self.dtype, device=self.device))
            out.copy_(k.gathered_attention(q, gathered, ok, C, cfg.softmax_scale))

        # `stream-race` drops this join: attention may read the selection before the indexer wrote it.
        if not self.faults.enabled("stream-race"):
            streams.join(INDEXER_STREAM)
        streams.submit(Task(f"attention.{layer}", MAIN, reads=("latent_cache", "selection"),
                            writes=("attn_out",), fn=attend))
        return self.all_reduce(self.linear(out.view(B, -1), w[p + "attn.wo.weight"]))

    def _indexer(self, layer: int, rows: slice, pos: torch.Tensor, write: torch.Tensor, ctx: torch.Tensor | None,
                 paged: tuple[torch.Tensor, torch.Tensor] | None, kv: KVCache) -> None:
        """paged: the int32 (page table, keys per row) of the indexer kernel; ctx: the torch path's slots."""
        cfg = self.cfg
        HI, DI, R = cfg.index_heads, cfg.index_dim, cfg.rope_dim
        h = self.hidden[rows]
        proj = self.linear(h, self.indexer_proj[layer])  # [B, HI * DI + DI + HI]: queries, key, head weights
        q = proj[:, :HI * DI].view(h.shape[0], HI, DI)
        k.rope_(q[..., DI - R:], pos, self.cos, self.sin)  # in place, as in _attention
        k.write_cache_rows(proj[:, HI * DI:HI * DI + DI], pos, write, self.cos, self.sin, kv.index_keys[layer], R)
        head_weights = proj[:, HI * DI + DI:] * (HI * DI) ** -0.5
        if self.indexer_selection is not None:  # reads the paged keys in place; -inf past each row's position
            assert paged is not None
            _, (selected, ok) = self.indexer_selection(q, head_weights.float(), kv.index_keys[layer], *paged,
                                                       self.page_size, pos, cfg.sliding_window, cfg.index_topk)
        else:
            assert ctx is not None
            scores = k.indexer_scores(q, head_weights, kv.index_keys[layer][ctx])
            selected, ok = k.select_slots(scores.float(), pos, cfg.sliding_window, cfg.index_topk)
        self.sel_pos[rows].copy_(selected)
        self.sel_ok[rows].copy_(ok)

    def _moe(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """h: the ffn-normed rows [B, D] -> the MoE output [B, D]."""
        cfg, w, p = self.cfg, self.w, f"layers.{layer}."
        weights, ids = k.route(self.linear(h, w[p + "moe.gate.weight"]), w[p + "moe.gate.e_score_correction_bias"],
                               cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor,
                               cfg.norm_topk_prob)
        if self.fused_moe is not None:
            return self.all_reduce(self.fused_moe(h, self.packed_moe[layer], weights, ids))
        per_slot = k.gathered_experts(h, ids, w[p + "moe.experts.w_gate"], w[p + "moe.experts.w_up"],
                                      w[p + "moe.experts.w_down"])
        out = torch.zeros_like(h)
        for slot in range(ids.shape[1]):  # rank order, as cpu.moe
            out = out + weights[:, slot:slot + 1].to(h.dtype) * per_slot[:, slot]
        if cfg.n_shared_experts:
            out = out + k.shared_expert(h, w[p + "moe.shared.w_gate"], w[p + "moe.shared.w_up"],
                                        w[p + "moe.shared.w_down"])
        return self.all_reduce(out)

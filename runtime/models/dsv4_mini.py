"""dsv4-mini forward pass: DeepSeek-V4's decode path at small scale.

Per layer: latent-MQA attention (one [latent | roped key] vector per token shared by all heads)
over `sliding window U indexer top-k`, then MoE (sqrtsoftplus / noaux_tc routing, SwiGLU experts,
shared expert). The lightning indexer is overlappable work: it is submitted to the "indexer" side
stream through the declared-stream API and joined before attention reads its selection.
T = tokens in the step, D = hidden, H = heads, C = latent, R = rope, HI/DI = indexer heads/dim.
Tensor parallel (runtime/distributed/sharding.py): this rank holds H/tp query heads (wq column-,
wo row-parallel) and 1/tp of every expert's intermediate; `all_reduce` sums the partial outputs of
attention and MoE. The latent KV, the indexer and the router are replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from runtime.config import ModelConfig
from runtime.faults import NO_FAULTS, FaultSet
from runtime.kernels.types import MoEWeights
from runtime.kvcache.kv_cache import KVCache
from runtime.models.batch import ForwardBatch
from runtime.streams.tasks import MAIN, StreamExecutor, Task

INDEXER_STREAM = "indexer"


class Workspace:
    """Buffers shared between streams inside one forward; persistent like a graph's static buffers."""

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None  # [T, D] normed input of the current layer
        self.selection: list[torch.Tensor] = []  # per segment [n_new, L] bool
        # Every row's selected tokens for attention: KV slots [T, W] (W = window + top-k, ascending
        # positions; columns past a row's count hold position 0's slot) and which are selected [T, W].
        self.selected_slots: torch.Tensor | None = None
        self.selected_valid: torch.Tensor | None = None


def gathered_positions(mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A selection mask [T, L] as each row's selected positions in ascending order, [T, width] (0, the
    always-written first position, past the row's count), and which of them are selected, [T, width]."""
    counts = mask.sum(-1)
    assert mask.shape[0] == 0 or int(counts.max()) <= width, "a row selected more tokens than window + top-k"
    rows, cols = mask.nonzero(as_tuple=True)
    rank = mask.cumsum(-1)[rows, cols] - 1
    positions = torch.zeros(mask.shape[0], width, dtype=torch.long)
    positions[rows, rank] = cols
    return positions, torch.arange(width)[None, :] < counts[:, None]


class DSV4Mini:
    def __init__(self, model_cfg: ModelConfig, weights: dict[str, torch.Tensor], kernels: ModuleType,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 faults: FaultSet = NO_FAULTS) -> None:
        self.model_cfg = model_cfg
        self.w = weights
        self.faults = faults
        self.all_reduce = all_reduce or (lambda t: t)
        self.num_heads = weights["layers.0.attn.wq.weight"].shape[0] // model_cfg.qk_head_dim  # this rank's heads
        self.k = kernels
        self.dtype = weights["embed.weight"].dtype
        self.lm_head = weights["embed.weight"] if model_cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.moe_weights = [self._moe_weights(i) for i in range(model_cfg.num_layers)]
        self.workspace = Workspace()

    def _moe_weights(self, layer: int) -> MoEWeights:
        p = f"layers.{layer}.moe."
        shared = self.model_cfg.n_shared_experts > 0
        return MoEWeights(
            router=self.w[p + "gate.weight"], bias=self.w[p + "gate.e_score_correction_bias"],
            w_gate=self.w[p + "experts.w_gate"], w_up=self.w[p + "experts.w_up"], w_down=self.w[p + "experts.w_down"],
            shared_gate=self.w[p + "shared.w_gate"] if shared else None,
            shared_up=self.w[p + "shared.w_up"] if shared else None,
            shared_down=self.w[p + "shared.w_down"] if shared else None,
        )

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        # Reference kernels compute in float64; the model's activations stay in the weight dtype.
        return t if t.dtype == self.dtype else t.to(self.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache, streams: StreamExecutor) -> torch.Tensor:
        """Writes the new tokens' KV and returns float32 logits [S, V] of the last token of each segment."""
        x = self.w["embed.weight"][batch.token_ids]
        for layer in range(self.model_cfg.num_layers):
            x = x + self._attention(layer, x, batch, kv, streams)
            x = x + self._moe(layer, x)
        streams.synchronize()
        last = self.k.rms_norm(x[batch.last_rows], self.w["norm.weight"], self.model_cfg.rms_norm_eps)
        return self.k.linear(self._cast(last), self.lm_head).float()

    def _attention(self, layer: int, x: torch.Tensor, batch: ForwardBatch, kv: KVCache,
                   streams: StreamExecutor) -> torch.Tensor:
        model_cfg, k, p = self.model_cfg, self.k, f"layers.{layer}."
        C, R = model_cfg.kv_latent_dim, model_cfg.rope_dim
        T = x.shape[0]
        ws = self.workspace
        ws.hidden = self._cast(k.rms_norm(x, self.w[p + "attn_norm.weight"], model_cfg.rms_norm_eps))

        streams.fork(INDEXER_STREAM)
        streams.submit(Task(f"indexer.{layer}", INDEXER_STREAM, reads=("hidden", "index_cache"),
                            writes=("index_cache", "selection"),
                            fn=lambda: self._indexer(layer, batch, kv)))

        q = self._cast(k.linear(ws.hidden, self.w[p + "attn.wq.weight"])).view(T, self.num_heads, C + R)
        q = torch.cat([q[..., :C], self._cast(k.rope(q[..., C:], batch.positions, model_cfg.rope_theta))], dim=-1)
        latent_and_rope = self._cast(k.linear(ws.hidden, self.w[p + "attn.wkv.weight"]))
        latent = self._cast(k.rms_norm(latent_and_rope[:, :C], self.w[p + "attn.kv_norm.weight"],
                                       model_cfg.rms_norm_eps))
        key_rope = self._cast(k.rope(latent_and_rope[:, C:], batch.positions, model_cfg.rope_theta))
        kv.latent[layer, batch.slots] = torch.cat([latent, key_rope], dim=-1)

        # NaN-poisoned: a row attention never wrote (e.g. after a stale selection) cannot pass for data.
        out = torch.full((T, self.num_heads, C), float("nan"), dtype=self.dtype)

        def attend() -> None:
            # A raced read (stream-race) may find no selection for this batch's rows: they stay NaN.
            if ws.selected_slots is not None and ws.selected_slots.shape[0] == T:
                out[:] = self._cast(self._attend(layer, q, batch, kv))

        # The `stream-race` fault drops this join: attention may then read the selection before the
        # indexer wrote it (the production bug); the step-end synchronize still drains the stream.
        if not self.faults.enabled("stream-race"):
            streams.join(INDEXER_STREAM)
        streams.submit(Task(f"attention.{layer}", MAIN, reads=("latent_cache", "selection"),
                            writes=("attn_out",), fn=attend))
        partial = self._cast(k.linear(out.view(T, self.num_heads * C), self.w[p + "attn.wo.weight"]))
        return self.all_reduce(partial)

    def _attend(self, layer: int, q: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Every row over its selected tokens, gathered: a fixed width whatever its segment (kernels/cpu.py)."""
        ws = self.workspace
        return self.k.gathered_attention(q, kv.latent[layer][ws.selected_slots], ws.selected_valid,
                                         self.model_cfg.kv_latent_dim, self.model_cfg.softmax_scale)

    def _indexer(self, layer: int, batch: ForwardBatch, kv: KVCache) -> None:
        """Lightning indexer: score every earlier token, keep the window plus the top-k."""
        model_cfg, k, p, ws = self.model_cfg, self.k, f"layers.{layer}.indexer.", self.workspace
        T, HI, DI, R = batch.token_ids.shape[0], model_cfg.index_heads, model_cfg.index_dim, model_cfg.rope_dim
        h = ws.hidden
        q = self._cast(k.linear(h, self.w[p + "wq.weight"])).view(T, HI, DI)
        q = torch.cat([q[..., :DI - R], self._cast(k.rope(q[..., DI - R:], batch.positions, model_cfg.rope_theta))], -1)
        key = self._cast(k.linear(h, self.w[p + "wk.weight"]))
        key = torch.cat([key[:, :DI - R], self._cast(k.rope(key[:, DI - R:], batch.positions, model_cfg.rope_theta))],
                        -1)
        head_weights = self._cast(k.linear(h, self.w[p + "weights_proj.weight"])) * (HI * DI) ** -0.5
        kv.index_keys[layer, batch.slots] = key
        # The `indexer-window-off-by-one` fault widens the window by one (`>= pos - window` for `>`):
        # a token too many in every long context, a logit shift too small to flip the greedy token.
        window = model_cfg.sliding_window + self.faults.enabled("indexer-window-off-by-one")
        selection, slots, valid = [], [], []
        for seg in batch.segments:
            keys = kv.index_keys[layer, seg.context_slots]
            rows = slice(seg.start, seg.end)
            scores = k.indexer_scores(q[rows], head_weights[rows], keys, batch.positions[rows])
            mask = k.selection_mask(scores, batch.positions[rows], window, model_cfg.index_topk)
            positions, selected = gathered_positions(mask, window + model_cfg.index_topk)
            selection.append(mask)
            slots.append(seg.context_slots[positions])
            valid.append(selected)
        ws.selection = selection
        ws.selected_slots, ws.selected_valid = torch.cat(slots), torch.cat(valid)

    def _moe(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        model_cfg = self.model_cfg
        h = self._cast(self.k.rms_norm(x, self.w[f"layers.{layer}.ffn_norm.weight"], model_cfg.rms_norm_eps))
        partial = self._cast(self.k.moe(h, self.moe_weights[layer], top_k=model_cfg.num_experts_per_tok,
                                        n_group=model_cfg.n_group, topk_group=model_cfg.topk_group,
                                        scaling=model_cfg.routed_scaling_factor,
                                        normalize=model_cfg.norm_topk_prob))
        return self.all_reduce(partial)

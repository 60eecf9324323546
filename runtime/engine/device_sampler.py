"""Sampling on the device, with results handed to the host without a blocking sync.

The overlap loop only hides the CPU's scheduling work if nothing on the host waits for the GPU
between launching step N+1 and processing step N. So a step's sampled tokens, logprobs and top
logprobs are copied to pinned host memory asynchronously and `PendingOutputs` waits on the copy's
event only when the loop first reads them (normal loop: at once; overlap loop: after launching
the next step).

Greedy rows are sampled on the device (argmax: first maximum, as `sample_row`). Rows with a
temperature are drawn on the device too (`draw_rows`): each row's uniform comes from its request's
own generator on the host, before the logits exist, and travels with the row's parameters in one
pinned write. So no step waits for the GPU to sample: drawing them on the host (their logits copied
over, `sample_row` per row) was the engine thread's largest wait for the GPU in the H200 gate (136 of
its 712 py-spy samples), each one making the overlap loop run host work and the GPU step in series.
On CPU the draw has `sample_row`'s bits; on the GPU a token can differ from the CPU's only where the
uniform falls within float32 rounding of a boundary of the cumulative distribution.
Forced tokens (a constrained opening) are written from pinned memory, without a sync.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from runtime.engine.request import Request
from runtime.engine.sampler import SampleOutput, draw_rows, forced_token


class PendingOutputs(Mapping):
    """rid -> SampleOutput, materialised on first access (waits for the copy event there)."""

    def __init__(self, rids: list[str], host: dict[str, torch.Tensor], top_counts: list[int],
                 event: torch.cuda.Event | None) -> None:
        self._rids, self._host, self._top_counts, self._event = rids, host, top_counts, event
        self._outputs: dict[str, SampleOutput] | None = None

    def _resolve(self) -> dict[str, SampleOutput]:
        if self._outputs is None:
            if self._event is not None:
                self._event.synchronize()
            tokens = self._host["tokens"].tolist()
            logprobs = self._host["logprobs"].tolist()
            if "top_ids" in self._host:
                tops = [list(zip(ids[:k], vals[:k])) for ids, vals, k in
                        zip(self._host["top_ids"].tolist(), self._host["top_vals"].tolist(), self._top_counts)]
            else:
                tops = [[] for _ in self._rids]
            outputs = dict(zip(self._rids, map(SampleOutput, tokens, logprobs, tops)))
            self._outputs = outputs
        return self._outputs

    def __getitem__(self, rid: str) -> SampleOutput:
        return self._resolve()[rid]

    def items(self):  # one resolved dict's view, not a lookup through the Mapping per key
        return self._resolve().items()

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolve())

    def __len__(self) -> int:
        return len(self._rids)


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device`, queued on the stream without a host sync. A copy from
    pageable memory (`torch.tensor(values, device=...)`, `tokens[i] = x`) first waits for the
    stream's work, the step's forward: under py-spy on the H200 the gate's engine thread spent ~10% of
    its samples in such writes, each making the overlap loop wait for the GPU."""
    host = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def sample_on_device(logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, PendingOutputs]:
    """logits: [n, V] float32 on the device, one row per request -> (tokens [n] on the device,
    their host-side outputs, pending)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    forced_rows: list[int] = []
    forced_ids: list[int] = []
    drawn: list[tuple[int, float, int, float, float]] = []  # row, temperature, top_k, top_p, uniform
    for i, req in enumerate(requests):
        params = req.params
        forced = forced_token(req) if params.forced_ids else None
        req.num_sampled += 1
        if forced is not None:  # no draw: the generator's stream starts after the forced opening
            forced_rows.append(i)
            forced_ids.append(forced)
        elif params.temperature != 0:
            # The same generator call as sample_row's, so a seeded request's stream is the same.
            uniform = float(torch.rand((), generator=req.generator, dtype=torch.float64))
            drawn.append((i, params.temperature, params.top_k or 0, params.top_p, uniform))
    if forced_rows:  # one write for the step, no sync
        tokens.index_put_((_on_device(forced_rows, logits.device),), _on_device(forced_ids, logits.device))
    if drawn:
        # One pinned float64 write carries every drawn row's index and parameters (all exact in
        # float64; temperature and top_p round to float32 as sample_row's scalars do).
        packed = torch.tensor(drawn, dtype=torch.float64, pin_memory=logits.device.type == "cuda")
        columns = packed.to(logits.device, non_blocking=True).T
        index = columns[0].long()
        picked = draw_rows(logits.index_select(0, index), columns[1].float(), columns[2].long(),
                           columns[3].float(), columns[4])
        tokens.index_put_((index,), picked)
    host = {"tokens": tokens, "logprobs": logprobs.gather(1, tokens[:, None])[:, 0]}
    top_counts = [req.params.top_logprobs or 0 for req in requests]
    k = max(top_counts, default=0)
    if k:
        top = torch.topk(logprobs, k, dim=-1)
        host["top_vals"], host["top_ids"] = top.values, top.indices
    if logits.device.type != "cuda":  # the static runner under test on CPU: already on the host
        return tokens, PendingOutputs([r.rid for r in requests], host, top_counts, None)
    host = {name: t.to("cpu", non_blocking=True) for name, t in host.items()}
    event = torch.cuda.Event()
    event.record()
    return tokens, PendingOutputs([r.rid for r in requests], host, top_counts, event)

"""`build_pd_side`: the prefill or decode glue for `runtime.serve --disaggregation-mode`, with the
engine's KV pool registered with the transfer engine (directly, or through a staging arena) and the
transfer metrics ready to attach."""

from __future__ import annotations

import argparse

from runtime.disagg.bootstrap import BootstrapRegistry
from runtime.disagg.decode import DecodeSide
from runtime.disagg.metrics import PDMetrics
from runtime.disagg.prefill import PrefillSide
from runtime.disagg.staging import default_staging_bytes, staged_bytes
from runtime.disagg.transfer import DEFAULT_MODE, KVTransfer, mode_unsupported
from runtime.engine.engine import Engine


def transfer_mode(args: argparse.Namespace, device: str) -> str:
    mode = args.disaggregation_transfer or DEFAULT_MODE
    unsupported = mode_unsupported(mode, device)
    if unsupported:
        raise ValueError(f"--disaggregation-transfer {mode}: {unsupported}")
    return mode


def build_pd_side(args: argparse.Namespace, engine: Engine, api_key: str | None = None):
    """`api_key`: the server's own (`--api-key`): a decode server shows it to its prefill servers."""
    if args.tp > 1:
        raise ValueError("--disaggregation-mode with --tp > 1 is not supported yet (one KV pool per server)")
    kv, cfg = engine.kv, engine.cfg
    mode = transfer_mode(args, cfg.device)
    one_prompt = staged_bytes(kv.latent, kv.index_keys, engine.pool.pages_for_tokens(cfg.max_model_len),
                              cfg.page_size)
    arena = (args.disaggregation_staging_mib << 20) if args.disaggregation_staging_mib else \
        default_staging_bytes(args.disaggregation_mode, one_prompt,
                              staged_bytes(kv.latent, kv.index_keys, engine.pool.num_pages, cfg.page_size))
    if arena < one_prompt:
        raise ValueError(f"--disaggregation-staging-mib {args.disaggregation_staging_mib}: one prompt of "
                         f"--max-model-len {cfg.max_model_len} tokens needs {-(-one_prompt >> 20)} MiB of staging")
    transfer = KVTransfer(kv.latent, kv.index_keys, engine.pool.page_size, faults=engine.faults, mode=mode,
                          staging_bytes=arena)
    metrics = PDMetrics()  # attached to the server's registry by ServerState
    if transfer.staging is not None:
        metrics.track_staging(transfer.staging)
    if args.disaggregation_mode == "prefill":
        return PrefillSide(engine, transfer, BootstrapRegistry(engine.faults), metrics, args.disaggregation_timeout)
    name = args.disaggregation_name or f"http://{args.host}:{args.port}"
    return DecodeSide(engine, transfer, name, metrics, args.disaggregation_timeout, engine.faults, api_key=api_key)

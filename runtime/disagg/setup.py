"""`build_pd_side`: the prefill or decode glue for `runtime.serve --disaggregation-mode`, with the
engine's KV pool registered with the transfer engine and the transfer metrics ready to attach."""

from __future__ import annotations

import argparse

from runtime.disagg.bootstrap import BootstrapRegistry
from runtime.disagg.decode import DecodeSide
from runtime.disagg.metrics import PDMetrics
from runtime.disagg.prefill import PrefillSide
from runtime.disagg.transfer import KVTransfer
from runtime.engine.engine import Engine


def build_pd_side(args: argparse.Namespace, engine: Engine):
    if args.tp > 1:
        raise ValueError("--disaggregation-mode with --tp > 1 is not supported yet (one KV pool per server)")
    kv = engine.kv
    transfer = KVTransfer(kv.latent, kv.index_keys, engine.pool.page_size, faults=engine.faults)
    metrics = PDMetrics()  # attached to the server's registry by ServerState
    if args.disaggregation_mode == "prefill":
        return PrefillSide(engine, transfer, BootstrapRegistry(engine.faults), metrics, args.disaggregation_timeout)
    name = args.disaggregation_name or f"http://{args.host}:{args.port}"
    return DecodeSide(engine, transfer, name, metrics, args.disaggregation_timeout, engine.faults)

"""Start the OpenAI-compatible server.

    python -m runtime.serve --model PATH_OR_PRESET [--host 127.0.0.1] [--port 30000]
        [--max-running N] [--api-key KEY] [--max-concurrent-requests N] [--inject-fault NAME ...]
        [--tp N] [--overlap] [--disaggregation-mode prefill|decode]

Binds loopback by default: exposing the server is a deliberate `--host 0.0.0.0`. With an API key
(`--api-key`, or DSV4_SERVER_API_KEY to keep it out of the process list) every route but /health
needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from runtime.interrupts import INTERRUPTED_RC, InterruptLatch, held_while_importing

# Ctrl-C while torch and the server import is noted, not lost (runtime/interrupts.py): a signal that
# landed in torch's import of numpy was swallowed, and the server started and served on. As a program,
# the latch holds from here until `main` has every module in.
_LATCH = held_while_importing(__name__)

from runtime.config import EngineConfig  # noqa: E402
from runtime.faults import KNOWN_FAULTS, FaultSet, UnknownFaultError  # noqa: E402
from runtime.server.http_stack import HTTP, LOOP  # noqa: E402

DEFAULT_HOST = "127.0.0.1"  # loopback: reachable from other machines only when asked for
STARTUP_FAILURE_RC = 3  # uvicorn's own exit status for a server that could not start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runtime.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory or preset name (e.g. tiny-random)")
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-running", type=int, default=EngineConfig.max_running_requests)
    parser.add_argument("--num-pages", type=int, default=EngineConfig.num_pages)
    parser.add_argument("--page-size", type=int, default=EngineConfig.page_size)
    parser.add_argument("--max-model-len", type=int, default=EngineConfig.max_model_len)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: DSV4_SERVER_API_KEY, else no key)")
    parser.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                        help="generation requests in flight at once; one more gets a 429 "
                             "(default: DSV4_SERVER_MAX_CONCURRENT)")
    parser.add_argument("--inject-fault", action="append", default=[], choices=sorted(KNOWN_FAULTS),
                        metavar="NAME", help="switch on a named fault (repeatable): " + ", ".join(sorted(KNOWN_FAULTS)))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gloo on CPU)")
    parser.add_argument("--overlap", action="store_true",
                        help="overlap scheduler: plan step N+1 while N runs (the default on cuda)")
    parser.add_argument("--disable-overlap", action="store_true",
                        help="GPU: the normal loop (plan, run, process in turn), to compare against")
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda or cuda:N; auto = cuda when a GPU is visible, else cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="activation/weight dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="GPU: run decode steps eagerly")
    parser.add_argument("--single-stream", action="store_true", help="GPU: run the indexer on the main stream")
    parser.add_argument("--moe-kernel", default="auto", choices=["auto", "torch", "triton"],
                        help="static runner's MoE: the fused Triton kernel (runtime/kernels/triton/moe.py) or the "
                             "torch reference ops; auto = triton on cuda, torch on cpu")
    parser.add_argument("--attention-kernel", default="auto", choices=["auto", "torch", "triton"],
                        help="static runner's indexer and sparse attention: the Triton kernels "
                             "(runtime/kernels/triton/indexer.py, attention.py) or the torch reference ops; "
                             "auto = triton on cuda, torch on cpu")
    parser.add_argument("--runner", default="auto", choices=["auto", "eager", "static"],
                        help="model runner: auto = static (capturable, one row per token) on cuda, eager on cpu")
    parser.add_argument("--disaggregation-mode", default=None, choices=["prefill", "decode"],
                        help="PD disaggregation (runtime/disagg): this server only prefills, or only decodes; "
                             "clients talk to `python -m runtime.router --prefill URL --decode URL`")
    parser.add_argument("--disaggregation-timeout", type=float, default=30.0, metavar="S",
                        help="PD: longest wait for the peer (room opened, KV written) before the request fails")
    parser.add_argument("--disaggregation-name", default=None,
                        help="PD decode: the name this server registers under with prefill servers "
                             "(default: its URL); a restart under the same name replaces the old session")
    parser.add_argument("--disaggregation-transfer", default=None, choices=["direct", "staged"],
                        help="PD: how KV pages move (runtime/disagg/transfer.py): staged (the default, and the only "
                             "one for a CUDA KV pool) gathers them into a registered host staging arena and writes "
                             "it in one piece; direct writes page runs between registered host pools. Both servers "
                             "of a pair must use the same")
    parser.add_argument("--disaggregation-staging-mib", type=int, default=None, metavar="MIB",
                        help="PD staged transfer: the staging arena's size (default: a decode server twice its "
                             "pool's KV, at most 8 GiB; a prefill server 64 MiB; either at least one prompt of "
                             "--max-model-len tokens)")
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse finished requests' KV pages for prompts that start alike. Allowed where hits are "
                             "proven bit-exact (the eager CPU runner; the GPU runner with the Triton kernels), without "
                             "--tp, colocated or --disaggregation-mode prefill; asking for it elsewhere, a decode "
                             "server included, is an error. Default: on on the CPU, off on a GPU (measured slower "
                             "there on the canary model)")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is visible")
    return name


def build_state(args: argparse.Namespace):
    from runtime.distributed.tp_engine import start_engine
    from runtime.engine.engine import Engine
    from runtime.env import Env
    from runtime.models.loader import load_model
    from runtime.server.app import ServerState
    from runtime.server.chat_template import ChatTemplate

    env = Env.load()
    loaded = load_model(args.model)
    device = resolve_device(args.device)
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    cfg = EngineConfig(device=device, dtype=dtype, cuda_graphs=not args.disable_cuda_graph,
                       multi_stream=not args.single_stream, runner=args.runner, moe_kernel=args.moe_kernel,
                       attention_kernel=args.attention_kernel,
                       num_pages=args.num_pages,
                       page_size=args.page_size, max_running_requests=args.max_running,
                       max_model_len=args.max_model_len,
                       max_prefill_tokens=max(EngineConfig.max_prefill_tokens, args.max_model_len),
                       prefix_cache=args.prefix_cache)
    # Refused where it is asked for and not allowed (the rule is the Engine's), before any worker rank starts.
    Engine.use_prefix_cache(cfg, env, tensor_parallel=args.tp > 1, disaggregation=args.disaggregation_mode)
    if args.overlap and args.disable_overlap:
        raise ValueError("--overlap and --disable-overlap contradict each other")
    overlap = args.overlap or (device != "cpu" and not args.disable_overlap)
    if args.disaggregation_mode:  # a transfer mode that cannot work on this device fails before the engine starts
        from runtime.disagg.setup import transfer_mode

        transfer_mode(args, device)
    engine = start_engine(loaded, cfg, faults=FaultSet.from_env(env, args.inject_fault), env=env, overlap=overlap,
                          tp=args.tp, disaggregation=args.disaggregation_mode)
    template = ChatTemplate.for_model(Path(loaded.path) if loaded.path else None)
    api_key = args.api_key or env.server_api_key
    pd = None
    if args.disaggregation_mode:
        from runtime.disagg.setup import build_pd_side

        pd = build_pd_side(args, engine, api_key)
    return ServerState(loaded, engine, template, env, api_key=api_key,
                       max_concurrent_requests=args.max_concurrent_requests, pd=pd)


def main(argv: list[str] | None = None) -> int:
    latch = _LATCH if _LATCH.holding else InterruptLatch.hold()  # imported (a test): hold from here
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    import runtime.distributed.tp_engine  # noqa: F401  (build_state's imports: torch and the engine)
    import runtime.models.loader  # noqa: F401
    from runtime.server.app import create_app
    from runtime.server.serving import GRACEFUL_SHUTDOWN_S, RuntimeServer, before_stop_listening

    if latch.release():
        return INTERRUPTED_RC
    try:
        state = build_state(args)
    except (ValueError, FileNotFoundError, UnknownFaultError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        config = uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level=args.log_level.lower(),
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                # Longer than clients keep idle connections (httpx: 5 s, uvicorn's own default):
                                # a server closing a keep-alive connection as the client reuses it drops a request.
                                timeout_keep_alive=75, loop=LOOP, http=HTTP)
        server = RuntimeServer(config, before_stop_listening(state))
        server.run()
        if not server.started:  # as `uvicorn.run` does: a server that could not start (its port taken)
            return STARTUP_FAILURE_RC
    finally:
        state.engine.shutdown()  # stops TP worker processes; a no-op at --tp 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The sparse MLA kernel's compiled resources per launch variant, without a GPU: registers, spills,
shared memory and the MMA instruction, from Triton's compiler for sm_90 and its bundled ptxas -v.

Occupancy follows from them (an H200 SM: 65,536 registers, 228 KB shared memory): a 4-warp
program at 255 registers takes 32,640 registers, so 2 fit by registers; shared memory may allow
fewer. Spills are local-memory traffic per thread. The compiler here (this checkout's Triton) may
not be the device image's: treat the numbers as leads, and time on the GPU (bench.mla_sweep --free).

    python -m bench.kernel_resources [--out resources.json] [--two-pass]

The device image's compiler (Triton 3.6 with its CUDA 12.8 ptxas) runs here too, without a GPU: unpack
its wheel beside this checkout's Triton and put it first on the path. Its counts can differ from
Triton 3.9's: the indexer's fused-maxima kernel took 120 registers with 3.6 and 137 with 3.9.

    pip download --no-deps -d /tmp/t36whl triton==3.6.0 && unzip -q -d /tmp/t36 /tmp/t36whl/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36:. python -m bench.kernel_resources
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for real (no device is needed to compile)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from runtime.kernels.triton import attention  # noqa: E402

SIGNATURE = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16", part_ptr="*bf16", stats_ptr="*fp32",
                 ticket_ptr="*i32", heads="i32", selected="i32", blocks_per_chunk="i32", sm_scale_log2="fp32",
                 stride_qt="i32", stride_qh="i32", stride_kv="i32", stride_idx="i32", stride_ot="i32", stride_oh="i32")
# The dsv4-slice deployment (H=64: 16-head blocks, 64-position blocks, 5 chunks, bf16 chunk sums)
# and the knobs bench.mla_sweep --free times.
VARIANTS: dict[str, dict[str, int | bool]] = {
    "deployment (gathered, registers) w4 s2": dict(),
    "gathered, memory fold w4 s2": dict(STREAM=True),
    "gathered w4 s1": dict(stages=1),
    "gathered, memory fold w4 s1": dict(STREAM=True, stages=1),
    "gathered w8 s2": dict(warps=8),
    "gathered, memory fold w8 s1": dict(STREAM=True, warps=8, stages=1),
    "spread + ticket w4 s2": dict(SPREAD=True, TICKET=True),
    "BLOCK_H 32 w8 s2": dict(BLOCK_H=32, warps=8),
    "BLOCK_H 64, memory fold w8 s2": dict(BLOCK_H=64, STREAM=True, warps=8),
    "BLOCK_H 64, one chunk w8 s2": dict(BLOCK_H=64, SPLITS=1, warps=8),
    "skip_tail w4 s2": dict(TAIL=True),
    "skip_tail w4 s1": dict(TAIL=True, stages=1),
    "skip_tail w8 s2": dict(TAIL=True, warps=8),
    "row sums as an MMA w4 s2": dict(ROWSUM_MMA=True),
    "row sums as an MMA, BLOCK_H 64 w8 s2": dict(ROWSUM_MMA=True, BLOCK_H=64, warps=8),
    "2 column blocks, BLOCK_H 64 w8 s2": dict(ROWSUM_MMA=True, BLOCK_H=64, V_SPLIT=2, warps=8),
}


def ptxas_candidates() -> list[str]:
    """Triton's bundled assemblers: the plain one first; the newer one where the plain one cannot
    read the PTX version this Triton emits."""
    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return [str(folder / name) for name in ("ptxas", "ptxas-blackwell") if (folder / name).exists()]


# The two-pass prefill form (mla_prefill): each pass at the deployment's numerics (BLOCK_S 64, bf16),
# per launch shape bench.mla_sweep --only-two-pass times.
SCORES_SIGNATURE = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", p_ptr="*bf16", alpha_ptr="*fp32",
                        keep_ptr="*fp32", take_ptr="*fp32", sum_ptr="*fp32", heads="i32", selected="i32",
                        blocks="i32", blocks_per_chunk="i32", chunks="i32", sm_scale_log2="fp32", stride_qt="i32",
                        stride_qh="i32", stride_kv="i32", stride_idx="i32")
VALUES_SIGNATURE = dict(kv_ptr="*bf16", idx_ptr="*i32", p_ptr="*bf16", alpha_ptr="*fp32", keep_ptr="*fp32",
                        take_ptr="*fp32", sum_ptr="*fp32", out_ptr="*bf16", heads="i32", selected="i32", blocks="i32",
                        blocks_per_chunk="i32", chunks="i32", stride_kv="i32", stride_idx="i32", stride_ot="i32",
                        stride_oh="i32")
TWO_PASS_VARIANTS = {
    "scores BLOCK_H 64 w8 s2": ("scores", dict(BLOCK_H=64, warps=8)),
    "scores BLOCK_H 64 w4 s2": ("scores", dict(BLOCK_H=64)),
    "scores BLOCK_H 64 w8 s1": ("scores", dict(BLOCK_H=64, warps=8, stages=1)),
    "scores BLOCK_H 32 w4 s2": ("scores", dict(BLOCK_H=32)),
    "scores BLOCK_H 64 w16 s2": ("scores", dict(BLOCK_H=64, warps=16)),
    "values 64 x 128 w8 s2": ("values", dict(BLOCK_V=128, V_BLOCKS=4, warps=8)),
    "values 64 x 128 w4 s2": ("values", dict(BLOCK_V=128, V_BLOCKS=4)),
    "values 64 x 256 w8 s2": ("values", dict(BLOCK_V=256, V_BLOCKS=2, warps=8)),
    "values 64 x 64 w4 s2": ("values", dict(BLOCK_V=64, V_BLOCKS=8)),
    "values 64 x 128 w8 s3": ("values", dict(BLOCK_V=128, V_BLOCKS=4, warps=8, stages=3)),
    "values 32 x 256 w4 s2": ("values", dict(BLOCK_H=32, BLOCK_V=256, V_BLOCKS=2)),
}


def resources(knobs: dict) -> dict:
    knobs = dict(knobs)
    warps, stages = knobs.pop("warps", 4), knobs.pop("stages", 2)
    constants = dict(LATENT=512, ROPE=64, SPREAD=False, TICKET=False, PRECISION="tf32", BLOCK_H=16, BLOCK_S=64,
                     BLOCK_C=512, BLOCK_R=64, V_SPLIT=1, NARROW=True, SPLITS=5, STREAM=False, TAIL=False,
                     BLOCK_ALL=1024, ROWSUM_MMA=False)
    constants.update(knobs)
    return compiled_resources(attention._sparse_mla_kernel, SIGNATURE, constants, warps, stages)


def two_pass_resources(which: str, knobs: dict) -> dict:
    from runtime.kernels.triton import mla_prefill

    knobs = dict(knobs)
    warps, stages = knobs.pop("warps", 4), knobs.pop("stages", 2)
    if which == "scores":
        constants = dict(LATENT=512, ROPE=64, PRECISION="tf32", BLOCK_H=64, BLOCK_S=64, BLOCK_C=512, BLOCK_R=64)
        fn, signature = mla_prefill._scores_pass, SCORES_SIGNATURE
    else:
        constants = dict(LATENT=512, PRECISION="tf32", NARROW=True, BLOCK_H=64, BLOCK_S=64, BLOCK_V=128, V_BLOCKS=4)
        fn, signature = mla_prefill._values_pass, VALUES_SIGNATURE
    constants.update(knobs)
    return compiled_resources(fn, signature, constants, warps, stages)


# The integer arguments' values at the deployment's launches (H=64, top-512 after a 128-position window: 640
# selected positions, 64-position chunks; a 4,096-row prefill pass: 10 blocks of 64 in 10 chunks). A launch
# specializes each integer equal to 1 to a constant, each multiple of 16 to that divisibility, and each pointer
# to 16-byte alignment; the compiled code (vector widths, pipelining, registers, spills) depends on it. The
# tables in docs/results.md before the twenty-sixth session compiled without any of it (`--unspecialized`):
# the H=64 launch's ~1.8 KB of spills came from that, not from the code a launch runs (228 bytes).
DEPLOYMENT_INTS = dict(heads=64, selected=640, blocks_per_chunk=1, blocks=10, chunks=10, stride_qt=64 * 576,
                       stride_qh=576, stride_kv=576, stride_idx=640, stride_ot=64 * 512, stride_oh=512)
SPECIALIZE = True  # main()'s --unspecialized clears it


def specialized(signature: dict, constants: dict) -> tuple[dict, dict, dict]:
    """(signature, constants, attrs) as the deployment's launch specializes them (DEPLOYMENT_INTS)."""
    signature, constants, attrs = dict(signature), dict(constants), {}
    if not SPECIALIZE:
        return signature, constants, attrs
    for index, (name, kind) in enumerate(list(signature.items())):
        value = DEPLOYMENT_INTS.get(name)
        if kind.startswith("*") or (kind == "i32" and value is not None and value % 16 == 0):
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif kind == "i32" and value == 1:
            signature[name], constants[name] = "constexpr", 1
    return signature, constants, attrs


def compiled_resources(fn, signature: dict, constants: dict, warps: int, stages: int) -> dict:
    signature, constants, attrs = specialized(signature, constants)
    signature = {**signature, **{key: "constexpr" for key in constants}}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False))
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    for ptxas in ptxas_candidates():
        report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                                capture_output=True, text=True)
        if report.returncode == 0:
            break
    os.unlink(f.name)
    text = report.stdout + report.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    shared = kernel.metadata.shared
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "?"
    row = dict(ptxas=Path(ptxas).name, warps=warps, stages=stages, mma=mma,
               registers=int(regs.group(1)) if regs else None,
               spill_store_bytes=int(spills.group(1)) if spills else None,
               spill_load_bytes=int(spills.group(2)) if spills else None, shared_bytes=shared)
    if regs:
        by_regs = 65536 // (int(regs.group(1)) * 32 * warps)
        row["programs_per_sm"] = min(by_regs, (228 * 1024) // max(shared, 1))
    if not regs:
        row["ptxas_output"] = text[-300:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--two-pass", action="store_true", help="the two-pass prefill form's kernels instead")
    parser.add_argument("--unspecialized", action="store_true",
                        help="compile without the launch's specialization (no alignment or divisibility), as the "
                             "tables before the twenty-sixth session did")
    args = parser.parse_args()
    global SPECIALIZE
    SPECIALIZE = not args.unspecialized
    rows = {}
    print(f"triton {triton.__version__} ({'specialized as the deployment launch' if SPECIALIZE else 'unspecialized'}); "
          "per thread: registers, spill bytes stored/loaded; per program: shared bytes; programs per SM "
          "(registers, shared memory)")
    # Each variant's compile, run in turn below (the two tables' entries have different shapes).
    variants: dict[str, Callable[[], dict]] = (
        {name: functools.partial(two_pass_resources, *knobs) for name, knobs in TWO_PASS_VARIANTS.items()}
        if args.two_pass else {name: functools.partial(resources, knobs) for name, knobs in VARIANTS.items()})
    for name, compile_variant in variants.items():
        rows[name] = r = compile_variant()
        print(f"{name:<40} {r['mma']:<8} regs {r['registers']} spills {r['spill_store_bytes']}/{r['spill_load_bytes']} "
              f"shared {r['shared_bytes']} -> {r.get('programs_per_sm')} per SM ({r['ptxas']})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(triton=triton.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()

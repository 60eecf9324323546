"""Compiles every kernel of kernels/triton/glue.py for an sm_90 GPU (the H200) without one, and
checks the RoPE kernels' PTX for fused multiply-adds (glue.NO_FMA says why there must be none).
The interpreter accepts code the GPU compiler rejects (non-constexpr globals, say), so the CPU tests
alone cannot tell that a kernel compiles. Run as a module in a process without TRITON_INTERPRET
(tests/kernels/test_fused_glue.py does); prints one line per kernel, exits 1 on any failure;
`--with-fma` compiles with contraction on, which must fail the FMA check (the negative control).
"""

from __future__ import annotations

import os
import re
import sys

assert os.environ.get("TRITON_INTERPRET") == "0", "run with TRITON_INTERPRET=0: the kernels must be compiled"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from runtime.kernels.triton import glue  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
BF16 = "*bf16"
ROPE_TABLE = {"cos_ptr": BF16, "sin_ptr": BF16}


def ptx(fn, signature: dict, constexprs: dict, options: dict) -> str:
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=H200, options=options).asm["ptx"]


def cases():
    """(name, kernel, signature, constexprs, launch options, must be FMA-free) as the wrappers launch them."""
    yield ("add_rms_norm", glue._add_rms_norm_kernel,
           {"x_ptr": BF16, "d_ptr": BF16, "w_ptr": BF16, "sum_ptr": BF16, "out_ptr": BF16, "width": "i32",
            "eps": "fp32", "stride_x": "i32", "stride_d": "i32", "stride_sum": "i32", "stride_out": "i32"},
           {"BLOCK": 4096}, {}, False)
    yield ("embed_rms_norm", glue._embed_rms_norm_kernel,
           {"ids_ptr": "*i64", "table_ptr": BF16, "w_ptr": BF16, "rows_ptr": BF16, "out_ptr": BF16,
            "width": "i32", "eps": "fp32", "stride_table": "i32", "stride_rows": "i32", "stride_out": "i32"},
           {"BLOCK": 4096}, {}, False)
    yield ("rope_", glue._rope_inplace_kernel,
           {"x_ptr": BF16, "pos_ptr": "*i64", **ROPE_TABLE, "heads": "i32", "half": "i32", "stride_xt": "i32",
            "stride_xh": "i32", "stride_tab": "i32"}, {"BLOCK_H": 64, "BLOCK_R": 32}, glue.NO_FMA, True)
    for norm in (True, False):
        yield (f"write_cache_rows(norm={norm})", glue._write_cache_rows_kernel,
               {"src_ptr": BF16, "pos_ptr": "*i64", "slot_ptr": "*i64", "norm_ptr": BF16, **ROPE_TABLE,
                "cache_ptr": BF16, "head": "i32", "half": "i32", "eps": "fp32", "stride_src": "i32",
                "stride_tab": "i32", "stride_cache": "i32"},
               {"NORM": norm, "BLOCK_C": 512, "BLOCK_R": 32}, glue.NO_FMA, True)
    for groups, size, topk_groups, top_k in ((8, 32, 4, 6), (1, 8, 1, 2)):
        yield (f"route(E={groups * size}, groups={groups})", glue._route_kernel,
               {"logits_ptr": BF16, "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64", "stride_l": "i32",
                "stride_w": "i32", "stride_i": "i32", "scaling": "fp32"},
               {"N_GROUP": groups, "GROUP_SIZE": size, "TOPK_GROUP": topk_groups, "TOP_K": top_k, "NORMALIZE": True,
                "BLOCK_G": triton.next_power_of_2(groups), "BLOCK_E": size, "BLOCK_K": triton.next_power_of_2(top_k)},
               {"num_warps": 2, **glue.NO_FMA}, False)
    yield ("selected_slots", glue._selected_slots_kernel,
           {"table_ptr": "*i64", "pos_ptr": "*i64", "ok_ptr": "*u8", "out_ptr": "*i32", "selected": "i32",
            "page_size": "i32", "stride_table": "i32", "stride_pos": "i32", "stride_ok": "i32", "stride_out": "i32"},
           {"BLOCK": 1024}, {}, False)


def main() -> int:
    # --with-fma: the negative control (RoPE compiled with contraction on must fail the check).
    with_fma = "--with-fma" in sys.argv[1:]
    failed = 0
    for name, fn, signature, constexprs, options, fma_free in cases():
        if with_fma:
            options = {key: value for key, value in options.items() if key not in glue.NO_FMA}
        try:
            code = ptx(fn, signature, constexprs, options)
        except Exception as e:  # report every kernel, not only the first failure
            print(f"FAIL {name}: does not compile: {str(e)[-600:]}")
            failed += 1
            continue
        fmas = len(re.findall(r"^\s*fma\.", code, re.M))
        if fma_free and fmas:
            print(f"FAIL {name}: {fmas} fused multiply-adds in the PTX")
            failed += 1
            continue
        print(f"ok   {name}" + (" (no fma)" if fma_free else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""A kernel the Triton interpreter runs and the compiler refuses (negative control of
test_indexer_topk's compile check): a constexpr annotation reassigned in a static_range."""

import triton
import triton.language as tl


@triton.jit
def reassigns_a_constexpr(out_ptr):
    total = 0
    for level in tl.static_range(2):
        shift: tl.constexpr = 8 * level
        total += shift
    tl.store(out_ptr, total)

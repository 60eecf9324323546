"""Per-dtype tolerances for fast-path-vs-reference comparisons, in one table (not per test).

The reference computes in float64; the fast path in the listed dtype. Values are (atol, rtol) for
`torch.testing.assert_close` on outputs of unit-scale inputs.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                              scale: float = 1.0, msg: str = "") -> None:
    """`scale` widens the tolerance for ops whose error grows with the reduction length."""
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64),
                               atol=atol * scale, rtol=rtol * scale, msg=lambda m: f"{msg}\n{m}" if msg else m)

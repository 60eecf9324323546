"""bench/decode_step.py's host-side pieces (the bench itself needs a GPU)."""

from __future__ import annotations

from bench.decode_step import fit, interleaved_times


def test_each_round_times_every_size_once_in_a_rotated_order():
    calls: list[int] = []

    def measure(n: int) -> float:
        calls.append(n)
        return float(len(calls))  # a host that slows down call after call

    rounds = interleaved_times(measure, [1, 16, 64], 3)
    assert calls == [1, 16, 64, 16, 64, 1, 64, 1, 16]
    assert [sorted(r) for r in rounds] == [[1, 16, 64]] * 3
    # The drift lands on a different size first in each round: no size is always timed last.
    assert [max(r, key=r.__getitem__) for r in rounds] == [64, 1, 16]


def test_the_fit_of_a_straight_line_is_exact():
    line = fit([(1, 1.5), (16, 3.0), (128, 14.2)])
    assert abs(line["a_ms"] - 1.4) < 1e-9 and abs(line["b_ms_per_req"] - 0.1) < 1e-9

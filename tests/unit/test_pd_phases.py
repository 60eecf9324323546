"""bench.pd_phases' headline figure: a path's time less its prompt step, per request, then the median."""

from __future__ import annotations

from bench.pd_phases import COLOCATED_COMPUTE, COLOCATED_PATH, PD_COMPUTE, PD_PATH, overhead_ms, phases


def test_each_path_names_its_compute_phase() -> None:
    assert PD_COMPUTE in dict(PD_PATH).values()
    assert COLOCATED_COMPUTE in dict(COLOCATED_PATH).values()


def test_overhead_is_each_requests_path_less_its_prompt_step_then_the_median() -> None:
    requests = [  # seconds: (queued, prompt step, to the client) = (4, 12, 4), (2, 25, 3), (1, 30, 9) ms
        {"client.sent": 0.0, "prefill.step_started": 0.004, "prefill.kv_held": 0.016, "client.first_token": 0.020},
        {"client.sent": 0.0, "prefill.step_started": 0.002, "prefill.kv_held": 0.027, "client.first_token": 0.030},
        {"client.sent": 0.0, "prefill.step_started": 0.001, "prefill.kv_held": 0.031, "client.first_token": 0.040},
        {"client.sent": 0.0, "client.first_token": 0.050},  # no prompt step marked: left out
    ]
    rows = [phases(PD_PATH, marks) for marks in requests]
    assert overhead_ms(rows, PD_COMPUTE) == 8.0  # the median of 8, 5 and 10 ms
    assert overhead_ms(rows[3:], PD_COMPUTE) is None

"""bench.kernels' MoE tune, second stage (`_fastest_keeping_bits` over the down-projection launches): a bucket's down
launch is taken only when it keeps the default config's bits and is faster than the bucket as the first stage left it;
a candidate the GPU cannot hold is skipped, not fatal. The MoE itself is stubbed: the stage's choice is what is tested
(the GPU runs the real one)."""

from __future__ import annotations

import sys

import pytest
import torch
import triton

from bench import kernels

pytestmark = pytest.mark.kernels

FIRST = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4}
WANT = torch.arange(6.0)


def _stage(monkeypatch, times: dict, wrong: set = frozenset(), too_big: set = frozenset(), first_us=10.0):
    """Run the tune's second stage over MOE_DOWN_CANDIDATES with each candidate's launch timed as `times` says
    (default 20 us), bit-different where in `wrong`, out of resources where in `too_big`."""
    def key(cfg):
        down = cfg.get("down")
        return None if down is None else (down["BLOCK_N"], down["N_TILES"], down["num_warps"], down["num_stages"])

    def run(x, i, w, cfg):
        k = key(cfg)
        if k in too_big:
            raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
        return WANT + 1 if k in wrong else WANT.clone()

    timing = {}

    def fake_graph_us(calls, reps=15):
        calls[0]()  # the stage times the candidate it just checked
        return timing["next"]

    monkeypatch.setattr(kernels, "graph_us", fake_graph_us)

    def timed_run(x, i, w, cfg):
        timing["next"] = times.get(key(cfg), 20.0)
        return run(x, i, w, cfg)
    inputs = [(None, None, None)] * 2
    candidates = [{**FIRST, "down": down} for down in kernels.MOE_DOWN_CANDIDATES]
    return kernels._fastest_keeping_bits(timed_run, inputs, WANT, candidates, dict(FIRST), first_us, "test")


def test_the_fastest_bit_keeping_down_launch_is_taken(monkeypatch):
    cands = [(c["BLOCK_N"], c["N_TILES"], c["num_warps"], c["num_stages"]) for c in kernels.MOE_DOWN_CANDIDATES]
    fastest, faster_but_wrong, too_big = cands[3], cands[1], cands[7]
    cfg, us = _stage(monkeypatch, {fastest: 7.0, faster_but_wrong: 5.0, too_big: 1.0, cands[0]: 8.0},
                     wrong={faster_but_wrong}, too_big={too_big})
    assert cfg == {**FIRST, "down": kernels.MOE_DOWN_CANDIDATES[3]} and us == 7.0


def test_no_down_launch_when_none_is_faster(monkeypatch):
    cfg, us = _stage(monkeypatch, {}, first_us=10.0)  # every candidate 20 us against the bucket's 10
    assert cfg == FIRST and us == 10.0


def test_down_candidates_are_knobs_a_table_may_set():
    from runtime.kernels.triton import configs

    name = "fused_moe,E=256,N=256,device_name=TEST_GPU,dtype=bf16.json"
    table = {str(i + 1): {**FIRST, "down": down} for i, down in enumerate(kernels.MOE_DOWN_CANDIDATES)}
    assert len(configs.check_table(name, table)) == len(kernels.MOE_DOWN_CANDIDATES)
    assert all(down["BLOCK_N"] >= 64 for down in kernels.MOE_DOWN_CANDIDATES)  # moe.down_launch's floor


def test_fused_split_candidates_are_knobs_a_table_may_set_and_reach_the_launch():
    """Each third-stage candidate passes the table check and is what moe.gate_up_launch gives a split shard's aligned
    bucket (FUSED_SPLITS on); a shard of one split, or the per-row path, never fuses (control)."""
    from runtime.kernels.triton import configs, moe

    name = "fused_moe,E=256,N=256,device_name=TEST_GPU,dtype=bf16.json"
    table = {str(i + 1): {**FIRST, "gate_up": fused} for i, fused in enumerate(kernels.MOE_FUSED_SPLIT_CANDIDATES)}
    assert len(configs.check_table(name, table)) == len(kernels.MOE_FUSED_SPLIT_CANDIDATES)
    for fused in kernels.MOE_FUSED_SPLIT_CANDIDATES:
        assert moe.gate_up_launch({**FIRST, "gate_up": fused}, moe.ALIGNED, split_k=4) == fused
        assert moe.gate_up_launch({**FIRST, "gate_up": fused}, moe.ALIGNED, split_k=1)["FUSED_SPLITS"] is False
        assert moe.gate_up_launch({**FIRST, "gate_up": fused}, moe.PER_ROW, split_k=4) == {**FIRST,
                                                                                            "FUSED_SPLITS": False}


def test_sigterm_ends_a_bench_run_as_ctrl_c_does():
    """gpu_suite's `timeout` stops a section with SIGTERM: bench.kernels (and mla_sweep) turn it into the
    KeyboardInterrupt their `finally` writes the JSON and the tune on, instead of dying with nothing written."""
    import os
    import signal
    import time

    previous = signal.signal(signal.SIGTERM, kernels.stop_on_sigterm)
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)  # the handler runs at once; without it this ends and the test fails
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_moe_splits_names_each_count_once_with_the_shapes_own():
    """`--moe-splits`: integers and "default" (moe.gate_up_splits at the shard), sorted, each once; anything else is
    refused by name before any GPU work."""
    from runtime.kernels.triton import moe

    own = moe.gate_up_splits(4096, 256)
    assert kernels.moe_splits("1,default", 4096, 256) == sorted({1, own})
    assert kernels.moe_splits("4,2,1,default", 4096, 256) == sorted({1, 2, 4, own})
    assert kernels.moe_splits("default", 4096, 2048) == [moe.gate_up_splits(4096, 2048)]
    for bad in ("0", "two", "1,,2", "-1"):
        with pytest.raises(ValueError, match="--moe-splits"):
            kernels.moe_splits(bad, 4096, 256)


def test_a_tune_without_the_deployments_split_is_refused_before_any_gpu_work(monkeypatch, capsys, tmp_path):
    """`--tune-out` tunes each shape at its own split count only: a `--moe-splits` list without "default" would tune
    nothing, so the command line is refused (the parser's exit 2, with the reason); with "default" it goes on to
    the device (here: the stubbed first GPU step)."""
    def no_gpu():
        raise RuntimeError("reached the GPU")
    monkeypatch.setattr(kernels, "measure_ceilings", no_gpu)
    argv = ["bench.kernels", "--json", str(tmp_path / "k.json"), "--only", "moe",
            "--tune-out", str(tmp_path / "t.json")]
    monkeypatch.setattr(sys, "argv", [*argv, "--moe-splits", "1,2"])
    with pytest.raises(SystemExit) as stop:
        kernels.main()
    assert stop.value.code == 2 and "must name 'default'" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", [*argv, "--moe-splits", "2,default"])
    with pytest.raises(RuntimeError, match="reached the GPU"):
        kernels.main()

"""canary.pd_target's placement of a PD pair's sides: a GPU each where the host has two (as a PD deployment runs
them), both on what there is otherwise, and the GPUs counted from CUDA_VISIBLE_DEVICES or `nvidia-smi -L`."""

from __future__ import annotations

import contextlib
import os
import stat

import pytest

from canary import pd_target
from canary.pd_target import embedded_pd_pair, placement_note, side_devices, visible_gpus


def test_visible_gpus_are_cuda_visible_devices_entries_where_it_is_set():
    never = lambda: pytest.fail("nvidia-smi asked although CUDA_VISIBLE_DEVICES is set")  # noqa: E731
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, never) == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": " 2 , GPU-5f3a "}, never) == ["2", "GPU-5f3a"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, never) == []
    assert visible_gpus({}, lambda: ["0", "1", "2"]) == ["0", "1", "2"]


def _fake_nvidia_smi(bin_dir, listing: str) -> None:
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat <<'END'\n{listing}END\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)


def test_without_cuda_visible_devices_the_gpus_are_nvidia_smis(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)\n  MIG 1g.10gb Device 0: (UUID: MIG-b)\n"
                               "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-c)\n")
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path), "/usr/bin", "/bin"]))  # the fake first
    assert visible_gpus({}) == ["0", "1"]
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    assert visible_gpus({}) == []  # a CPU host


def test_the_sides_take_a_gpu_each_only_where_there_are_two():
    assert side_devices([]) == {} and side_devices(["0"]) == {}
    assert side_devices(["3", "5", "7"]) == {"prefill": {"CUDA_VISIBLE_DEVICES": "3"},
                                             "decode": {"CUDA_VISIBLE_DEVICES": "5"}}
    assert placement_note(side_devices(["0", "1"])) == "PD pair: prefill on GPU 0, decode on GPU 1"
    assert placement_note({}) == "PD pair: both sides on the same device(s)"


class _Started(Exception):
    """Raised by the fake server once both sides were asked for: the router is not started."""


def _record_sides(monkeypatch) -> dict[str, dict]:
    started: dict[str, dict] = {}

    @contextlib.contextmanager
    def fake_server(model, args, *, env=None, **kwargs):
        role = args[args.index("--disaggregation-mode") + 1]
        started[role] = dict(env or {})
        if role == "decode":
            raise _Started
        yield None

    monkeypatch.setattr(pd_target, "embedded_server", fake_server)
    return started


@pytest.mark.parametrize("visible,want", [("0,1", {"prefill": {"CUDA_VISIBLE_DEVICES": "0"},
                                                   "decode": {"CUDA_VISIBLE_DEVICES": "1"}}),
                                          ("0", {"prefill": {}, "decode": {}})])
def test_the_pair_starts_each_side_with_its_device(monkeypatch, visible, want):
    started = _record_sides(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(_Started), embedded_pd_pair("unused"):
        pass
    assert started == want
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible  # the harness's own environment is left alone


def test_the_restartable_pair_starts_each_side_with_its_device_beside_its_own_env(monkeypatch, tmp_path):
    started = _record_sides(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    pair = pd_target.RestartablePDPair("unused", log_dir=tmp_path, env={"DSV4_SLOW_STEP_MS": "5"})
    pair.start_side("prefill")
    with pytest.raises(_Started):
        pair.start_side("decode")
    assert started == {"prefill": {"DSV4_SLOW_STEP_MS": "5", "CUDA_VISIBLE_DEVICES": "4"},
                       "decode": {"DSV4_SLOW_STEP_MS": "5", "CUDA_VISIBLE_DEVICES": "6"}}

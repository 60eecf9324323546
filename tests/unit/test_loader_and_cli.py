"""HF-style loading round trip, clear load errors, and the generate CLI contract."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from runtime.models.loader import load_model, save_model

pytestmark = pytest.mark.unit


def test_save_and_load_round_trip(tmp_path):
    tiny = load_model("tiny-random")
    save_model(tmp_path / "m", tiny.config, tiny.weights)
    again = load_model(str(tmp_path / "m"))
    assert again.config == tiny.config
    assert again.weights_hash == tiny.weights_hash


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="preset"):
        load_model(str(tmp_path / "missing"))
    tiny = load_model("tiny-random")
    save_model(tmp_path / "m", tiny.config, tiny.weights)
    from safetensors.torch import save_file

    broken = dict(tiny.weights)
    broken["norm.weight"] = torch.ones(3)
    save_file(broken, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="norm.weight"):
        load_model(str(tmp_path / "m"))


def test_generate_cli_prints_the_documented_json():
    out = subprocess.run([sys.executable, "-m", "runtime.generate", "--model", "tiny-random", "--requests", "3",
                          "--max-tokens", "4", "--seed", "1", "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert {"requests", "pages_in_use", "steps", "tokens_per_s"} <= set(result)
    assert len(result["requests"]) == 3 and result["pages_in_use"] == 0 and result["steps"] > 0
    for r in result["requests"]:
        assert {"prompt_ids", "token_ids", "logprobs"} <= set(r)
        assert len(r["token_ids"]) == len(r["logprobs"]) >= 1


def test_generate_cli_rejects_bad_arguments():
    bad = subprocess.run([sys.executable, "-m", "runtime.generate", "--requests", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--requests" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "runtime.generate", "--model", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "preset" in bad.stderr

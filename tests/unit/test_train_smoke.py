"""CPU smoke run of `python -m runtime.train` (a few steps): it writes a model directory that the
loader and the engine accept, and the loss is computed on assistant tokens."""

from __future__ import annotations

import json

import pytest

from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import load_model
from runtime.server.chat_template import DEFAULT_TEMPLATE, TEMPLATE_NAME
from runtime.train.__main__ import main

pytestmark = pytest.mark.unit


def test_smoke_training_writes_a_servable_model(tmp_path):
    main(["--out", str(tmp_path), "--preset", "smoke", "--steps", "2"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "train_log.jsonl"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / TEMPLATE_NAME).read_bytes() == DEFAULT_TEMPLATE.read_bytes()
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert log and all(row["ce"] > 0 for row in log)
    loaded = load_model(str(tmp_path))
    engine = Engine(loaded, EngineConfig(num_pages=64), faults=FaultSet(), env=Env(num_threads=1))
    req = engine.generate([loaded.tokenizer.encode("<｜User｜>hi<｜Assistant｜></think>")],
                          SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(req.output_ids) == 4

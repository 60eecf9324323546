"""CPU smoke run of `python -m runtime.train` (a few steps): it writes a model directory that the
loader and the engine accept, and the loss is computed on assistant tokens."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.request import SamplingParams
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.models.loader import load_model
from runtime.server.chat_template import DEFAULT_TEMPLATE, TEMPLATE_NAME
from runtime.train.__main__ import main
from runtime.train.loop import TrainConfig

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


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _differing(a: dict, b: dict, bias_atol: float) -> list[str]:
    """Names whose tensors differ; the noaux_tc routing bias is not a gradient parameter (a learning
    rate of 0 leaves it moving by bias_update per step), so it is compared within bias_atol."""
    assert a.keys() == b.keys()
    atol = {True: bias_atol, False: 0.0}
    return [n for n in a if not torch.allclose(a[n], b[n], rtol=0, atol=atol[n.endswith("e_score_correction_bias")])]


def test_init_continues_from_a_model_dir(tmp_path):
    """`--init DIR` starts from DIR's weights and tokenizer: at a learning rate of 0 the saved weights
    are DIR's, and DIR's tokenizer file is copied, not retrained. Negative control: the same run
    without --init saves other weights and a tokenizer of its own."""
    base, cont, fresh = tmp_path / "base", tmp_path / "cont", tmp_path / "fresh"
    tiny = ["--preset", "smoke", "--batch-size", "1"]  # one short session a step: seconds, not tens
    main(["--out", str(base), *tiny, "--steps", "1"])
    # The same tokenizer written with other whitespace: still base's ids, but bytes no retraining gives.
    tok = base / "tokenizer.json"
    tok.write_text(json.dumps(json.loads(tok.read_text()), indent=1, ensure_ascii=False))
    steps = 2
    continued = [*tiny, "--steps", str(steps), "--lr", "0", "--seed", "1"]
    main(["--out", str(cont), "--init", str(base), *continued])
    bias_atol = steps * TrainConfig.bias_update + 1e-9
    assert not _differing(_weights(base), _weights(cont), bias_atol)
    assert (cont / "tokenizer.json").read_bytes() == tok.read_bytes()
    summary = json.loads((cont / "train_summary.json").read_text())
    assert summary["steps"] == steps and summary["init"]["from"] == str(base)

    main(["--out", str(fresh), *continued])
    assert _differing(_weights(base), _weights(fresh), bias_atol)
    assert (fresh / "tokenizer.json").read_bytes() != tok.read_bytes()


@pytest.mark.parametrize("init", ["empty", "no-tokenizer", "tiny-random"])
def test_init_that_is_not_a_model_dir_is_refused(tmp_path, init):
    """A clear error, before the output directory is started: an empty directory, one without the
    tokenizer the weights' ids come from, and a preset name (a loadable model, but not a directory)."""
    if init != "tiny-random":
        init_dir = tmp_path / init
        init_dir.mkdir()
        (init_dir / "config.json").write_text("{}")
        if init == "no-tokenizer":
            (init_dir / "model.safetensors").write_bytes(b"")
        init = str(init_dir)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"not a model directory \(no .*tokenizer\.json"):
        main(["--out", str(out), "--preset", "smoke", "--steps", "1", "--init", init])
    assert not out.exists()

"""`python -m canary golden compare A B`: two stores hold the same transcripts or not, metadata aside (what
canary.gate.SAME_NUMERICS_AS rests on). Each way a transcript can differ is planted and must be named."""

from __future__ import annotations

import dataclasses
import json

import pytest

from canary.__main__ import main
from canary.oracles.golden import EXIT_REGRESSION, Transcript, write_store

META = {"model_hash": "7d301cb38daa920e", "device": "NVIDIA H200", "commit": "abc"}


def _transcripts() -> list[Transcript]:
    return [Transcript(f"session-{s}-req-0", [5 + s, 9, 2], [[[5 + s, -0.1], [7, -2.5]]] * 3, {}, [-0.1, -0.2, -0.3])
            for s in range(3)]


def _stores(tmp_path, other: list[Transcript], other_meta: dict | None = None):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_store(a, META, _transcripts())
    write_store(b, other_meta or {**META, "device": "NVIDIA H100 80GB HBM3", "commit": "def"}, other)
    return str(a), str(b)


def test_the_same_transcripts_under_other_metadata_are_the_same(tmp_path, capsys):
    assert main(["golden", "compare", *_stores(tmp_path, _transcripts())]) == 0
    out = capsys.readouterr().out
    assert "the same transcripts: 3 shared, 0 differ" in out
    assert json.loads(out.splitlines()[0])["b"]["device"] == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("plant, named", [
    (lambda t: dataclasses.replace(t, tokens=[t.tokens[0], 11, 2]), "the tokens part at position 1: 9 in A, 11 in B"),
    (lambda t: dataclasses.replace(t, logprobs=[-0.1, -0.2, -0.30000001]), "other logprobs or top-k"),
    (lambda t: dataclasses.replace(t, top_logprobs=[[[t.tokens[0], -0.1], [8, -2.5]]] * 3), "other logprobs or top-k"),
])
def test_each_kind_of_difference_is_named(tmp_path, capsys, plant, named):
    other = _transcripts()
    other[1] = plant(other[1])
    assert main(["golden", "compare", *_stores(tmp_path, other)]) == EXIT_REGRESSION
    out = capsys.readouterr().out
    assert named in out and "NOT the same transcripts: 3 shared, 1 differ" in out


def test_a_transcript_that_ends_early_is_named(tmp_path, capsys):
    other = _transcripts()
    other[0] = dataclasses.replace(other[0], tokens=other[0].tokens[:2])
    assert main(["golden", "compare", *_stores(tmp_path, other)]) == EXIT_REGRESSION
    assert "position 2: 2 in A, '(ended)' in B" in capsys.readouterr().out


def test_a_missing_transcript_is_not_the_same(tmp_path, capsys):
    assert main(["golden", "compare", *_stores(tmp_path, _transcripts()[:2])]) == EXIT_REGRESSION
    assert '"only_in_a": 1' in capsys.readouterr().out


def test_a_missing_store_or_other_weights_is_an_error(tmp_path, capsys):
    a, b = _stores(tmp_path, _transcripts(), {**META, "model_hash": "0000"})
    assert main(["golden", "compare", a, b]) == 2
    assert "other weights" in capsys.readouterr().err
    assert main(["golden", "compare", a, str(tmp_path / "absent.jsonl")]) == 2
    assert "no golden store" in capsys.readouterr().err

"""The tuned launch tables (runtime/kernels/triton/configs/*.json): every committed file is a table of
batch-size buckets that set only knobs which keep a row's bits, and a file that sets anything else (a
reduction step, a misspelt knob, a value the kernel cannot take) is refused when it loads, naming the
file, the bucket and the knob, instead of being followed or ignored."""

from __future__ import annotations

import json

import pytest

from runtime.kernels.triton import configs

pytestmark = pytest.mark.kernels

NAME = "fused_moe,E=256,N=256,device_name=TEST_GPU,dtype=bf16.json"
GOOD = {"1": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
        "4096": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2,
                 "gate_up": {"FUSED_SPLITS": True, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
                 "down": {"BLOCK_N": 128, "N_TILES": 4, "num_warps": 8, "num_stages": 2}}}


@pytest.mark.parametrize("path", sorted(configs.CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_committed_table_sets_only_bit_keeping_knobs(path):
    table = configs.check_table(path.name, json.loads(path.read_text()))
    assert 1 in table, "batches of one token need a bucket of their own: they would take the next one's launch"
    assert path.name.startswith("fused_moe,E=") and ",device_name=" in path.name


def test_a_good_table_loads_with_integer_buckets():
    assert configs.check_table(NAME, GOOD) == {1: GOOD["1"], 4096: GOOD["4096"]}


def _with(bucket: str, **changes) -> dict:
    table = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        where = table[bucket]
        *path, last = key.split("__")
        for part in path:
            where = where[part]
        if value is None:
            del where[last]
        else:
            where[last] = value
    return table


@pytest.mark.parametrize("table, words", [
    (_with("1", BLOCK_K=64), ["bucket 1", "'BLOCK_K'", "not a knob"]),  # the reduction step: a row's bits
    (_with("4096", down__SPLIT_K=2), ["bucket 4096.down", "'SPLIT_K'"]),
    (_with("1", BLOCK_N=48), ["BLOCK_N", "power of two", "48"]),
    (_with("1", num_warps=True), ["num_warps", "True"]),
    (_with("4096", gate_up__FUSED_SPLITS=1), ["FUSED_SPLITS", "true or false"]),
    (_with("1", num_stages=None), ["bucket 1", "missing", "num_stages"]),
    (_with("1", gate_up=[]), ["bucket 1.gate_up", "an object"]),
    ({"0": GOOD["1"]}, ["bucket '0'", "positive token count"]),
    ({"bs8": GOOD["1"]}, ["bucket 'bs8'"]),
    ({"8": GOOD["1"], "4096": GOOD["4096"]}, ["no bucket 1", "[8, 4096]", "one-token batches"]),
    ({}, ["non-empty"]),
    ([GOOD["1"]], ["non-empty object"]),
])
def test_a_table_that_sets_anything_else_is_refused_by_name(table, words):
    with pytest.raises(configs.ConfigError) as err:
        configs.check_table(NAME, table)
    assert NAME in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_an_unknown_kernel_kind_is_refused():
    with pytest.raises(configs.ConfigError, match="no knobs are known for kernel kind 'fused_mla'"):
        configs.check_table(NAME.replace("fused_moe", "fused_mla"), GOOD)


def test_loading_a_bad_file_fails_instead_of_following_it(tmp_path, monkeypatch):
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.load_table.cache_clear()
    try:
        (tmp_path / NAME).write_text(json.dumps(GOOD))
        assert configs.pick(configs.load_table(NAME), 3000) == GOOD["4096"]
        bad = NAME.replace("TEST_GPU", "BAD_GPU")
        (tmp_path / bad).write_text(json.dumps(_with("1", BLOCK_K=64)))
        with pytest.raises(configs.ConfigError, match="BLOCK_K"):
            configs.load_table(bad)
        assert configs.load_table(NAME.replace("TEST_GPU", "ABSENT_GPU")) == {}  # no file: the default launch
    finally:
        configs.load_table.cache_clear()


# ---- installing a tune (`python -m runtime.kernels.triton.configs install`)

TUNED_NAME = NAME  # device TEST_GPU
DECODE = {"1": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 5}, "8": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4}}


def _write(directory, name, table) -> None:
    (directory / name).write_text(json.dumps(table))


def _tune(tmp_path, tables: dict):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(tables))
    return path


def test_install_replaces_the_tuned_buckets_and_keeps_the_larger_ones(tmp_path):
    tables = tmp_path / "configs"
    tables.mkdir()
    _write(tables, NAME, {"1": GOOD["1"], "16": GOOD["1"], "4096": GOOD["4096"]})
    lines = configs.install(_tune(tmp_path, {NAME: DECODE}), tables)
    written = json.loads((tables / NAME).read_text())
    # 1 and 8 are the tune's; 16 and 4096, above its largest bucket, stay as they were
    assert list(written) == ["1", "8", "16", "4096"]
    assert written["1"] == DECODE["1"] and written["8"] == DECODE["8"]
    assert written["16"] == GOOD["1"] and written["4096"] == GOOD["4096"]
    assert lines[0] == f"{NAME}: 2 bucket(s) changed" and any(line.startswith("  8: (none) ->") for line in lines)
    configs.check_table(NAME, written)


def test_install_borrows_another_devices_larger_buckets_for_a_new_file_and_says_so(tmp_path):
    tables = tmp_path / "configs"
    tables.mkdir()
    other = NAME.replace("TEST_GPU", "OTHER_GPU")
    _write(tables, other, {"1": GOOD["1"], "4096": GOOD["4096"]})
    lines = configs.install(_tune(tmp_path, {NAME: DECODE}), tables, borrow_from="OTHER_GPU")
    written = json.loads((tables / NAME).read_text())
    assert list(written) == ["1", "8", "4096"] and written["4096"] == GOOD["4096"]
    assert any("4096" in line and "from OTHER_GPU, not timed on this device" in line for line in lines)
    # without --borrow-from a new file holds the tune alone
    alone = tmp_path / "alone"
    alone.mkdir()
    configs.install(_tune(tmp_path, {NAME: DECODE}), alone)
    assert list(json.loads((alone / NAME).read_text())) == ["1", "8"]


def test_a_tune_without_bucket_one_is_refused_and_a_dropped_bucket_is_named(tmp_path):
    """A few buckets picked out of a run would replace the whole range below the largest: refused by name, nothing
    written. A whole tune that times other buckets than the file's says which of the file's it dropped."""
    tables = tmp_path / "configs"
    tables.mkdir()
    _write(tables, NAME, {"1": GOOD["1"], "4": GOOD["1"], "16": GOOD["1"], "4096": GOOD["4096"]})
    before = (tables / NAME).read_text()
    with pytest.raises(configs.ConfigError, match="no bucket 1"):
        configs.install(_tune(tmp_path, {NAME: {"8": DECODE["8"]}}), tables)
    assert (tables / NAME).read_text() == before
    lines = configs.install(_tune(tmp_path, {NAME: DECODE}), tables)
    assert list(json.loads((tables / NAME).read_text())) == ["1", "8", "16", "4096"]
    assert any(line.startswith("  4: ") and line.endswith("dropped (below the tune's largest bucket, not timed)")
               for line in lines)
    assert not any(line.startswith(("  16:", "  4096:")) for line in lines)  # kept as they were: nothing to say


def test_a_bad_tuned_launch_installs_nothing(tmp_path):
    tables = tmp_path / "configs"
    tables.mkdir()
    _write(tables, NAME, GOOD)
    before = (tables / NAME).read_text()
    second = NAME.replace("N=256", "N=512")
    bad = {NAME: DECODE, second: {"1": {**DECODE["1"], "BLOCK_K": 64}}}
    with pytest.raises(configs.ConfigError, match="BLOCK_K"):
        configs.install(_tune(tmp_path, bad), tables)
    assert (tables / NAME).read_text() == before and not (tables / second).exists()


def test_install_command_line(tmp_path, capsys):
    tables = tmp_path / "configs"
    tables.mkdir()
    assert configs.main(["install", str(_tune(tmp_path, {NAME: DECODE})), "--dir", str(tables)]) == 0
    assert f"{NAME}: 2 bucket(s) changed" in capsys.readouterr().out
    assert configs.main(["install", str(_tune(tmp_path, {"../x.json": DECODE})), "--dir", str(tables)]) == 1
    assert "not a config file name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        configs.main(["install", str(tmp_path / "absent.json")])
    assert "no such file" in capsys.readouterr().err

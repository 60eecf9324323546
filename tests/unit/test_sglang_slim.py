"""bench/sglang_kernels.py's slim wheel: scripts/sglang_wheel.sh keeps only what the bench loads from SGLang's wheel
(its REAL modules and the E=256 MoE tables), so a device call can carry it beside .whl. A fake wheel stands in for
the real one (CI has none; tests/kernels/test_sglang_kernels.py loads the kernels from the real slim copy)."""

from __future__ import annotations

import zipfile

import pytest

from bench import sglang_kernels as sk

TABLE = sk.CONFIG_DIR + "triton_3_4_0/E=256,N=256,device_name=NVIDIA_H200.json"
OTHER_TABLE = sk.CONFIG_DIR + "triton_3_4_0/E=128,N=256,device_name=NVIDIA_H200.json"


def _fake_wheel(tmp_path, skip: str | None = None):
    wheel = tmp_path / "sglang-0.5.23-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for module in sk.REAL:
            name = module.replace(".", "/") + ".py"
            if name != skip:
                zf.writestr(name, f"# {module}\n")
        zf.writestr(TABLE, "{}")
        zf.writestr(OTHER_TABLE, "{}")
        zf.writestr("sglang/srt/server.py", "# not loaded by the bench\n")
    return wheel


def test_the_slim_wheel_holds_what_the_bench_loads_and_nothing_else(tmp_path):
    out = tmp_path / "carry"
    out.mkdir()
    slim = sk.slim_wheel(_fake_wheel(tmp_path), out)
    assert slim.name == "sglang-0.5.23-slim.whl" and sk.wheel_version(slim) == "0.5.23"
    assert sk.find_wheel(out) == slim
    with zipfile.ZipFile(slim) as zf:
        names = set(zf.namelist())
        assert names == {m.replace(".", "/") + ".py" for m in sk.REAL} | {TABLE}
        assert set(sk.wheel_members(zf)) == names  # the bench finds in it all it unpacks


def test_a_wheel_without_a_module_the_bench_loads_is_refused_by_name(tmp_path):
    missing = sk.REAL[-1].replace(".", "/") + ".py"
    with pytest.raises(SystemExit, match="triton_sparse_mla_decode"):
        sk.slim_wheel(_fake_wheel(tmp_path, skip=missing), tmp_path)
    assert not list(tmp_path.glob("*-slim.whl"))


def test_the_command_line(tmp_path, capsys):
    wheel = _fake_wheel(tmp_path)
    assert sk.main(["--slim", str(wheel), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip().endswith("sglang-0.5.23-slim.whl")
    with pytest.raises(SystemExit):
        sk.main(["--slim", str(tmp_path / "absent.whl"), str(tmp_path / "out")])
    assert "no such wheel" in capsys.readouterr().err

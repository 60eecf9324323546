"""Golden store first-divergence logic, the golden CLI, and bisect on throwaway repositories."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from canary.cli.bisect import SKIP, bisect, classify
from canary.oracles.golden import Transcript, first_divergence, read_store, write_store

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def transcript(tokens, tops=None):
    return Transcript("s", tokens, tops or [[(t, -0.1)] for t in tokens])


def test_identical_runs_have_no_divergence():
    assert first_divergence(transcript([1, 2, 3]), transcript([1, 2, 3])) is None


def test_divergence_at_a_recorded_near_tie_is_benign():
    golden = Transcript("s", [1, 2, 3], [[(1, -0.1)], [(2, -0.70), (9, -0.71)], [(3, -0.1)]])
    div = first_divergence(golden, transcript([1, 9, 4]))
    assert div.position == 1 and div.benign and abs(div.margin - 0.01) < 1e-9


def test_divergence_beyond_the_margin_or_outside_top_k_is_a_regression():
    golden = Transcript("s", [1, 2], [[(1, -0.1)], [(2, -0.1), (9, -2.0)]])
    wide = first_divergence(golden, transcript([1, 9]))
    assert not wide.benign and "margin" in wide.reason
    unknown = first_divergence(golden, transcript([1, 7]))
    assert not unknown.benign and "top-k" in unknown.reason
    shorter = first_divergence(golden, transcript([1]))
    assert not shorter.benign and shorter.reason == "lengths differ"


def test_store_round_trip(tmp_path):
    t = Transcript("a", [1, 2], [[(1, -0.5), (3, -1.0)], [(2, -0.2)]], {"prompt_ids": [5]})
    write_store(tmp_path / "g.jsonl", {"commit": "x"}, [t])
    meta, loaded = read_store(tmp_path / "g.jsonl")
    assert meta == {"commit": "x"} and loaded["a"] == t
    (tmp_path / "bad.jsonl").write_text('{"scenario": 1}\n')
    with pytest.raises(ValueError, match="metadata"):
        read_store(tmp_path / "bad.jsonl")


def test_golden_check_passes_clean_and_fails_on_a_planted_fault(tmp_path):
    store = tmp_path / "g.jsonl"
    cmd = [sys.executable, "-m", "canary", "golden"]
    subprocess.run(cmd + ["record", "--model", "tiny-random", "--scenarios", "6", "--store", str(store)],
                   check=True, capture_output=True, cwd=ROOT)
    clean = subprocess.run(cmd + ["check", "--model", "tiny-random", "--store", str(store)], capture_output=True,
                           text=True, cwd=ROOT)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    env = {"DSV4_FAULTS": "kv-slot-reuse", "PATH": "/usr/bin:/bin"}
    faulty = subprocess.run(cmd + ["check", "--model", "tiny-random", "--store", str(store)], capture_output=True,
                            text=True, cwd=ROOT, env=env)
    assert faulty.returncode == 3 and "first divergence" in faulty.stdout


def test_exit_status_mapping():
    assert classify(0) == 0 and classify(1) == 1 and classify(3) == 1
    assert classify(2) == SKIP and classify(127) == SKIP and classify(-11) == SKIP


def _commit(repo: Path, message: str) -> str:
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], cwd=repo, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()


def _init(repo: Path) -> None:
    repo.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=repo, check=True)


def test_bisect_finds_the_planted_commit_and_skips_crashes(tmp_path):
    repo = tmp_path / "repo"
    _init(repo)
    check = f"{sys.executable} check.py"
    (repo / "check.py").write_text(
        "import sys\nstate = open('state').read().strip()\n"
        "sys.exit({'ok': 0, 'fault': 3, 'crash': 2}[state])\n")
    (repo / "state").write_text("ok")
    good = _commit(repo, "good")
    (repo / "other").write_text("1")
    _commit(repo, "unrelated")
    (repo / "state").write_text("fault")
    planted = _commit(repo, "turn the fault on")
    (repo / "state").write_text("crash")
    _commit(repo, "broken build")
    (repo / "state").write_text("fault")
    bad = _commit(repo, "fix the build, fault still on")
    head_before = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
    result = bisect(repo, good, bad, check)
    assert result["first_bad"] == planted, result["log"]
    assert result["subject"] == "turn the fault on"
    head_after = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
    assert head_after == head_before, "bisect must leave the user's checkout untouched"
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=repo, capture_output=True, text=True).stdout
    assert len(worktrees.strip().splitlines()) == 1, "the temporary worktree must be removed"


def test_bisect_with_the_real_golden_check_finds_a_commit_that_turns_a_fault_on(tmp_path):
    repo = tmp_path / "proj"
    _init(repo)
    for name in ("runtime", "canary"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__", "server", "train"))
    good = _commit(repo, "clean runtime")
    store = tmp_path / "golden.jsonl"
    subprocess.run([sys.executable, "-m", "canary", "golden", "record", "--model", "tiny-random", "--scenarios", "4",
                    "--max-tokens", "12", "--store", str(store)], cwd=repo, check=True, capture_output=True)
    env_py = repo / "runtime" / "env.py"
    env_py.write_text(env_py.read_text().replace(
        "faults: tuple[str, ...] = field(default_factory=tuple)",
        'faults: tuple[str, ...] = ("kv-slot-reuse",)'))
    planted = _commit(repo, "default faults: kv-slot-reuse")
    (repo / "NOTES").write_text("later work\n")
    bad = _commit(repo, "later unrelated work")
    check = f"{sys.executable} -m canary golden check --model tiny-random --store {store}"
    result = bisect(repo, good, bad, check)
    assert result["first_bad"] == planted, result["log"]


def test_a_gpu_without_a_store_borrows_a_same_numerics_kinds_but_records_its_own(tmp_path, monkeypatch):
    """An H100 (float32) is checked against the H200's store while it has none of its own; a recording writes
    its own path, and once that exists it is used. Another dtype, or a kind with no such finding, is not
    borrowed (control: the same lookups without the H200's file give the H100's own path)."""
    from canary import gate
    from canary.targets import Target

    monkeypatch.setattr(gate, "GOLDEN_DIR", tmp_path)
    target = Target("t", "http://x/v1", "canary-moe-v2", True)
    engine = {"device": "cuda", "dtype": "float32", "moe_kernel": "triton", "attention_kernel": "triton"}
    h100 = {"model": "canary-moe-v2", "device_name": "NVIDIA H100 80GB HBM3", "engine_config": engine}
    own = tmp_path / "stress-canary-moe-v2.nvidia-h100-80gb-hbm3-float32-moe-triton-attention-triton.jsonl"
    h200 = tmp_path / "stress-canary-moe-v2.nvidia-h200-float32-moe-triton-attention-triton.jsonl"
    assert gate.golden_path(target, h100) == own  # control: nothing to borrow yet
    h200.write_text("{}\n")
    assert gate.golden_path(target, h100) == h200
    assert gate.golden_path(target, h100, own=True) == own
    bf16 = {**h100, "engine_config": {**engine, "dtype": "bfloat16"}}
    assert gate.golden_path(target, bf16).name.startswith("stress-canary-moe-v2.nvidia-h100-80gb-hbm3-bfloat16")
    other = {**h100, "device_name": "NVIDIA A100-SXM4-80GB"}
    assert gate.golden_path(target, other).name.startswith("stress-canary-moe-v2.nvidia-a100")
    own.write_text("{}\n")
    assert gate.golden_path(target, h100) == own


def test_golden_store_is_per_numerics():
    """CPU float32 keeps the store CI checks; a GPU gets one per device model and dtype."""
    from canary.gate import golden_path
    from canary.targets import Target

    target = Target("t", "http://x/v1", "canary-moe-v2", True)
    cpu = golden_path(target, {"model": "canary-moe-v2", "engine_config": {"device": "cpu", "dtype": "float32"}})
    gpu = golden_path(target, {"model": "canary-moe-v2", "device_name": "NVIDIA H200",
                               "engine_config": {"device": "cuda", "dtype": "float32"}})
    bf16 = golden_path(target, {"model": "canary-moe-v2", "device_name": "NVIDIA H200",
                                "engine_config": {"device": "cuda", "dtype": "bfloat16"}})
    assert cpu.name == "stress-canary-moe-v2.jsonl"
    assert gpu.name == "stress-canary-moe-v2.nvidia-h200-float32.jsonl"
    assert len({cpu, gpu, bf16}) == 3
    assert golden_path(target, {"model": "canary-moe-v2"}) == cpu  # an older server without engine_config
    # Each non-default kernel is another numerics: its own store beside the torch kernels' one.
    triton = golden_path(target, {"model": "canary-moe-v2", "device_name": "NVIDIA H200",
                                  "engine_config": {"device": "cuda", "dtype": "bfloat16", "moe_kernel": "triton",
                                                    "attention_kernel": "triton"}})
    assert triton.name == "stress-canary-moe-v2.nvidia-h200-bfloat16-moe-triton-attention-triton.jsonl"
    default_kernels = {"device": "cuda", "dtype": "float32", "moe_kernel": "torch", "attention_kernel": "torch"}
    assert golden_path(target, {"model": "canary-moe-v2", "device_name": "NVIDIA H200",
                                "engine_config": default_kernels}) == gpu

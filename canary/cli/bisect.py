"""`python -m canary bisect --good REV --bad REV [--check CMD]`: find the commit that broke the canary.

Runs `git bisect run` in a temporary detached worktree, so the user's checkout, branch and index
are never touched, and removes the worktree afterwards whatever happens. The default check is the
golden check against the store of the current checkout (its absolute path), executed with the
worktree's code. Exit codes of a check: 0 good, `EXIT_REGRESSION` (3, the golden check's) or 1 bad,
anything else (import errors, crashes, signals, a missing command) is "cannot test" -> 125 (skip).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from canary.oracles.golden import EXIT_REGRESSION

SKIP = 125


def classify(returncode: int) -> int:
    """Map a check's exit status to git bisect's vocabulary."""
    if returncode == 0:
        return 0
    if returncode in (1, EXIT_REGRESSION):
        return 1
    return SKIP


def run_step(command: str) -> int:
    """Entry for one bisect step (called by `git bisect run` inside the worktree)."""
    try:
        proc = subprocess.run(command, shell=True)
    except OSError:
        return SKIP
    return classify(proc.returncode)


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=check)


def bisect(repo: Path, good: str, bad: str, check: str) -> dict:
    repo = repo.resolve()
    good_sha = _git(repo, "rev-parse", "--verify", f"{good}^{{commit}}").stdout.strip()
    bad_sha = _git(repo, "rev-parse", "--verify", f"{bad}^{{commit}}").stdout.strip()
    with tempfile.TemporaryDirectory(prefix="canary-bisect-") as tmp:
        worktree = Path(tmp) / "wt"
        _git(repo, "worktree", "add", "--detach", str(worktree), bad_sha)
        try:
            _git(worktree, "bisect", "start", bad_sha, good_sha)
            step = f"{shlex.quote(sys.executable)} -m canary.bisect_step {shlex.quote(check)}"
            env = {**os.environ, "PYTHONPATH": str(worktree)}
            proc = subprocess.run(["git", "bisect", "run", "sh", "-c", step], cwd=worktree, capture_output=True,
                                  text=True, env=env)
            log = proc.stdout + proc.stderr
            match = re.search(r"^([0-9a-f]{40}) is the first bad commit", log, re.MULTILINE)
            skipped = "only skipped commits left" in log
            first_bad = match.group(1) if match else None
            subject = _git(repo, "log", "-1", "--format=%s", first_bad).stdout.strip() if first_bad else None
            return {"first_bad": first_bad, "subject": subject, "undecided_due_to_skips": skipped,
                    "good": good_sha, "bad": bad_sha, "log": log}
        finally:
            _git(worktree, "bisect", "reset", check=False)
            _git(repo, "worktree", "remove", "--force", str(worktree), check=False)
            _git(repo, "worktree", "prune", check=False)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bisect", help="find the first bad commit with the golden check")
    p.add_argument("--good", required=True, help="a revision known to pass")
    p.add_argument("--bad", required=True, help="a revision known to fail")
    p.add_argument("--check", default=None,
                   help="shell command run in each candidate worktree (default: golden check against this "
                        "checkout's store); exit 0 good, 1 or 3 bad, anything else skip")
    p.add_argument("--store", default=None, help="golden store for the default check")
    p.add_argument("--repo", default=".", help="repository to bisect (default: current directory)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from runtime.config import default_model

    check = args.check
    if check is None:
        store = Path(args.store or f"golden/transcripts/{Path(default_model()).name}.jsonl").resolve()
        if not store.is_file():
            print(f"error: no golden store at {store}; record one first or pass --check", file=sys.stderr)
            return 2
        check = f"{shlex.quote(sys.executable)} -m canary golden check --store {shlex.quote(str(store))}"
    try:
        result = bisect(Path(args.repo), args.good, args.bad, check)
    except subprocess.CalledProcessError as exc:
        print(f"error: git {' '.join(exc.cmd[1:])} failed: {exc.stderr.strip()}", file=sys.stderr)
        return 2
    if result["first_bad"]:
        print(f"first bad commit: {result['first_bad']} {result['subject']}")
        return 0
    print("bisect could not decide" + (" (only skipped commits left)" if result["undecided_due_to_skips"] else ""))
    print(result["log"][-2000:])
    return 1

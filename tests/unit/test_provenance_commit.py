"""canary.provenance.git_commit: a copy whose files differ from HEAD names the tree of its files."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from canary.provenance import git_commit, working_tree

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo, *args) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(repo), "PATH": "/usr/bin:/bin"}).stdout.strip()


def test_a_dirty_copy_names_the_tree_of_its_files(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git(repo, "add", "a.py")
    git(repo, "commit", "-qm", "one")
    head = git(repo, "rev-parse", "--short", "HEAD")
    assert git_commit(repo) == head  # clean: the commit alone
    (repo / "a.py").write_text("x = 2\n")
    (repo / "new.py").write_text("y = 1\n")  # untracked, not ignored: part of what runs
    # The tree a commit of these files would have, made the ordinary way in a second clone.
    other = tmp_path / "other"
    git(repo, "clone", "-q", str(repo), str(other))
    shutil.copy(repo / "a.py", other / "a.py")
    shutil.copy(repo / "new.py", other / "new.py")
    git(other, "add", "-A")
    want = git(other, "write-tree")
    assert working_tree(repo) == want
    assert git_commit(repo) == f"{head}-dirty-tree{want[:7]}"
    assert git(repo, "status", "--porcelain").count("??") == 1  # the repository's own index untouched


def test_outside_a_repository_nothing_is_made_up(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above it either
    assert git_commit(tmp_path) == "unknown" and working_tree(tmp_path) is None

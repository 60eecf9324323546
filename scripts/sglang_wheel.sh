#!/usr/bin/env bash
# Download SGLang's wheel (no dependencies) and keep in .whl-sglang/ (git-ignored) a slim copy of what
# `python -m bench.kernels --vs-sglang` loads from it (bench/sglang_kernels.py `slim_wheel`: its Triton kernel
# modules and E=256 MoE tables, 76 KB): the GPU machine has no internet, so it travels with the tree
# (device run with carry=[".whl-sglang"], which now fits beside .whl in the 64 MiB carry). The bench unpacks
# those files at run time; no SGLang code is ever committed here.
#   bash scripts/sglang_wheel.sh            (SGLANG_VERSION=... to pick another pinned version)
set -euo pipefail
cd "$(dirname "$0")/.."
# Pinned: the version issue 15's first side-by-side table was measured against.
VERSION=${SGLANG_VERSION:-0.5.23}
# The slimming imports bench/sglang_kernels.py (torch, triton): the project's venv (`make install`).
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p .whl-sglang
# Only this version's slim wheel in the directory: the bench picks the single sglang-*.whl it finds.
find .whl-sglang -name 'sglang-*.whl' ! -name "sglang-$VERSION-slim.whl" -delete
if [ ! -f ".whl-sglang/sglang-$VERSION-slim.whl" ]; then
    full=$(mktemp -d)
    trap 'rm -rf "$full"' EXIT
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$full" "sglang==$VERSION"
    "$PY" -m bench.sglang_kernels --slim "$full"/sglang-"$VERSION"-*.whl .whl-sglang
fi
du -sh .whl-sglang

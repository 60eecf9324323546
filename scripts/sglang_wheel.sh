#!/usr/bin/env bash
# Download SGLang's wheel (no dependencies) into .whl-sglang/ (git-ignored), for
# `python -m bench.kernels --vs-sglang`: the GPU machine has no internet, so the wheel travels with
# the tree (device run with carry=[".whl-sglang"]). bench/sglang_kernels.py unpacks only the Triton
# kernel files it needs from the wheel at run time; no SGLang code is ever committed here.
#   bash scripts/sglang_wheel.sh            (SGLANG_VERSION=... to pick another pinned version)
set -euo pipefail
cd "$(dirname "$0")/.."
# Pinned: the version issue 15's first side-by-side table was measured against.
VERSION=${SGLANG_VERSION:-0.5.23}
PY=${PY:-python3}
mkdir -p .whl-sglang
# Only this one wheel in the directory: the bench picks the single sglang-*.whl it finds, and the
# carried directory stays small.
find .whl-sglang -name 'sglang-*.whl' ! -name "sglang-$VERSION-*" -delete
ls .whl-sglang/sglang-"$VERSION"-*.whl >/dev/null 2>&1 || \
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl-sglang "sglang==$VERSION"
du -sh .whl-sglang

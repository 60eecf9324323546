#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels the lent GPU image lacks for the server and harness:
# the versions this checkout's .venv has, for CPython 3.12 on x86-64 (device README, Notes). The GPU
# scripts (gpu_suite.sh, gpu_tp.sh) install whatever lies in .whl/ before they run.
#   bash scripts/device_wheels.sh        (then pass carry=[".whl"] to the device run)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# The image has torch, triton, numpy, httpx, pytest, hypothesis, uvloop, ...; these are what it lacks.
NAMES="fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection typing_extensions
uvicorn h11 httptools click anyio sniffio idna openai jiter distro httpx2 httpcore2 truststore certifi jsonschema
jsonschema-specifications referencing rpds-py attrs opentelemetry-api importlib_metadata zipp prometheus_client"
mkdir -p .whl
for name in $NAMES; do
    version=$($PY -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    [ -n "$version" ] || { echo "skip $name (not in $PY's environment)"; continue; }
    ls .whl | grep -qi "^$(echo "$name" | tr '-' '_')-$version-" && continue
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$name==$version"
done
# Profiling only (gpu_suite.sh's gate_profile section); not a dependency of the project, so pinned here.
ls .whl | grep -q "^py_spy-0.4.3-" || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl py-spy==0.4.3
du -sh .whl

"""A real `python -m runtime.serve` on a free port (like vLLM's RemoteOpenAIServer), shared by the
e2e tests of one module."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canary.targets import embedded_server

API_KEY = "test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with embedded_server("tiny-random", max_running=64, log_dir=tmp_path_factory.mktemp("server"),
                         extra_args=["--api-key", API_KEY]) as target:
        yield replace(target, api_key=API_KEY)  # so harness helpers (canary.gate) send the key

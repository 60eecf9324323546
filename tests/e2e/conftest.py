"""A real `python -m runtime.serve` on a free port (like vLLM's RemoteOpenAIServer), shared by the
e2e tests of one module."""

from __future__ import annotations

import pytest

from canary.targets import embedded_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, api_key):
    with embedded_server("tiny-random", ["--api-key", api_key], max_running=64,
                         log_dir=tmp_path_factory.mktemp("server")) as target:
        yield target

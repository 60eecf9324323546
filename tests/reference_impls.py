"""The other implementations our DSML parser and chat template are tested against, imported once:

- SGLang's `deepseekv4` tool-call detector and DeepSeek's V3.2 reference encoder/parser
  (`encoding_dsv32`), both inside the sglang wheel;
- DeepSeek's V4 prompt encoder, `deepseek-recipe` (SGLang renders DeepSeek-V4 prompts with it).

`make install` puts them in the venv (`pip install --no-deps`, see the Makefile's REFERENCE_PKGS).
Outside CI a test that needs one skips with the import error as its reason, so a developer without
them still runs the rest. In CI (`CI` set, as .ci/run does) a missing one is a failure: a
differential that silently skips there would look like a pass.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest


def _why_missing(importer: Callable[[], Any]) -> tuple[Any, str]:
    try:
        return importer(), ""
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"{type(exc).__name__}: {exc}"


def _import_sglang():
    # sglang imports `requests`, which warns that no charset detector is installed; nothing here
    # makes an HTTP request, so the warning would only be noise in every test summary.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Unable to find acceptable character detection")
        return _import_sglang_modules()


def _import_sglang_modules():
    from sglang.srt.entrypoints.openai import encoding_dsv32
    from sglang.srt.entrypoints.openai.protocol import Function, Tool
    from sglang.srt.function_call.deepseekv4_detector import DeepSeekV4Detector

    return encoding_dsv32, Function, Tool, DeepSeekV4Detector


def _import_recipe():
    import deepseek_recipe

    return deepseek_recipe


_sglang, _sglang_error = _why_missing(_import_sglang)
encoding_dsv32, Function, Tool, DeepSeekV4Detector = _sglang or (None, None, None, None)
deepseek_recipe, _recipe_error = _why_missing(_import_recipe)

SGLANG_MISSING = (f"sglang's function_call module and DeepSeek's V3.2 encoder are not importable "
                  f"({_sglang_error}); `make install` installs them") if _sglang_error else ""
RECIPE_MISSING = (f"DeepSeek's V4 encoder (deepseek-recipe) is not importable ({_recipe_error}); "
                  f"`make install` installs it") if _recipe_error else ""


def in_ci(environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get("CI", "")
    return value.strip().lower() not in ("", "0", "false", "no")


def needs(missing: str, *, ci: bool | None = None) -> Callable[[Callable], Callable]:
    """Decorator for a test that needs a reference implementation (`missing` is "" when it is
    importable, else why not). Put it above `@given`: under CI the test is replaced by one that
    fails with the reason, elsewhere it is skipped with it."""
    ci = in_ci() if ci is None else ci

    def decorate(test: Callable) -> Callable:
        if not missing:
            return test
        if not ci:
            return pytest.mark.skip(reason=missing)(test)

        def fails_in_ci() -> None:  # no parameters: pytest must not look for the original's fixtures
            pytest.fail(f"CI must run this differential, but {missing}", pytrace=False)

        fails_in_ci.__name__ = test.__name__
        fails_in_ci.__qualname__ = test.__qualname__
        fails_in_ci.__module__ = test.__module__
        fails_in_ci.__doc__ = test.__doc__
        return fails_in_ci

    return decorate


needs_sglang = needs(SGLANG_MISSING)
needs_recipe = needs(RECIPE_MISSING)

"""The guard that keeps the differential tests from skipping in CI (tests/reference_impls.py)."""

from __future__ import annotations

import pytest

from tests.reference_impls import in_ci, needs

pytestmark = pytest.mark.unit


def _test_needing_a_fixture(reply):  # a stand-in for a hypothesis test with parameters
    return reply


def test_available_reference_leaves_the_test_alone():
    assert needs("", ci=True)(_test_needing_a_fixture) is _test_needing_a_fixture
    assert needs("", ci=False)(_test_needing_a_fixture) is _test_needing_a_fixture


def test_missing_reference_outside_ci_skips_with_the_import_error_as_reason():
    marked = needs("sglang is not importable (ModuleNotFoundError: No module named 'sglang')",
                   ci=False)(_test_needing_a_fixture)
    (mark,) = [m for m in marked.pytestmark if m.name == "skip"]
    assert "No module named 'sglang'" in mark.kwargs["reason"]


def test_missing_reference_in_ci_is_a_failure_not_a_skip():
    replaced = needs("sglang is not importable (No module named 'sglang')", ci=True)(_test_needing_a_fixture)
    assert replaced.__name__ == _test_needing_a_fixture.__name__  # same test id in the report
    assert not getattr(replaced, "pytestmark", [])  # no skip mark left on it
    with pytest.raises(pytest.fail.Exception, match="CI must run this differential.*No module named"):
        replaced()  # takes no parameters, so pytest collects it without the original's fixtures


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("True", True), ("yes", True),
                                             ("", False), ("0", False), ("false", False)])
def test_ci_is_recognised_as_dot_ci_run_and_the_ci_service_set_it(value, expected):
    assert in_ci({"CI": value}) is expected
    assert in_ci({}) is False

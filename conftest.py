"""Root conftest: loads the canary pytest plugin and the hypothesis profiles."""

import os

from hypothesis import HealthCheck, Verbosity, settings

# Imported first for its side effect: without CUDA it switches Triton's interpreter on. Triton picks
# the interpreter when a @jit function is defined - triton.language's own helpers (tl.sum, tl.cumsum)
# included - so it must happen before any test module imports triton: a module that imported sglang
# first (the DSML differential) got those helpers compiled, and every interpreted kernel in that
# worker then failed with "Cannot call @triton.jit'd outside of the scope of a kernel".
import runtime.kernels.triton  # noqa: E402, F401, I001

# Installed, the package registers the plugin itself (pyproject.toml's pytest11 entry point, under
# this same name, so this line is then a no-op); from a bare checkout on PYTHONPATH, this loads it.
pytest_plugins = ["canary.pytest_plugin"]

settings.register_profile("dev", max_examples=25, deadline=None)
# CI: derandomized (a red run reproduces), no deadline (shared 2-core machines), print the blob.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=1000, deadline=None, verbosity=Verbosity.normal)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

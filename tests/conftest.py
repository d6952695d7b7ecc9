"""Shared test helpers.

GPU tests run only where a Hopper GPU is visible; elsewhere they skip with a reason.
Set JAX_HOPPER_REQUIRE_GPU=1 (the device script does) to turn that skip into a failure,
so a GPU run can never pass by skipping.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

# The tests check the installed package (with its compiled extension). `python -m pytest`
# from the repository root would put the source tree, which has no extension, first on
# sys.path; drop it before anything imports jax_hopper.
_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.curdir).resolve() != _REPO_ROOT]

# The tests exercise our kernel, so they force its path past the dispatcher (also in
# the subprocesses some tests start); the dispatcher's own tests opt back into "auto".
os.environ["JAX_HOPPER_DISPATCH"] = "kernel"
# pytest-xdist workers share the machine's GPU: each takes memory as it goes instead of
# preallocating most of it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

# Eight CPU devices for the sharding tests (must precede backend initialisation; it
# leaves GPU backends alone). Without the option the sharding tests skip.
try:
    jax.config.update("jax_num_cpu_devices", 8)
except (AttributeError, ValueError):
    pass

from helpers import hopper_devices  # noqa: E402

REQUIRE_GPU = os.environ.get("JAX_HOPPER_REQUIRE_GPU") == "1"


def _gpu_skip_reason():
    if hopper_devices():
        return None
    return "needs a Hopper (sm_90) GPU visible to jax; none found"


def _require_hopper():
    reason = _gpu_skip_reason()
    if reason is not None:
        if REQUIRE_GPU:
            pytest.fail(f"JAX_HOPPER_REQUIRE_GPU=1 but {reason}")
        pytest.skip(reason)
    return hopper_devices()[0]


@pytest.fixture
def hopper():
    return _require_hopper()


@pytest.fixture(scope="module")
def hopper_module():
    """`hopper` for module-scoped fixtures (which run before function-scoped ones, so
    they cannot lean on `hopper` to skip first)."""
    return _require_hopper()

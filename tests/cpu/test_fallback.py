"""Where the kernel must not run: non-Hopper CUDA GPUs get XLA's dot with one warning."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import decided

import jax_hopper
from jax_hopper import _ffi, _problem


class _FakeGpu:
    platform = "gpu"
    compute_capability = "8.0"


def test_non_hopper_gpu_lowers_to_xla_dot_with_one_warning(monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [_FakeGpu()])
    _ffi.local_gpus_are_hopper.cache_clear()
    _ffi.warn_no_kernel_once.cache_clear()
    try:
        a = jax.ShapeDtypeStruct((64, 32), jnp.float16)
        b = jax.ShapeDtypeStruct((32, 16), jnp.float16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                text = jax.jit(jax_hopper.matmul).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
        assert "custom_call" not in text and re.search(r"dot_general", text)
        msgs = [str(w.message) for w in caught if "not a Hopper" in str(w.message)]
        assert len(msgs) == 1, msgs
    finally:
        _ffi.local_gpus_are_hopper.cache_clear()
        _ffi.warn_no_kernel_once.cache_clear()


NN = (((1,), (0,)), ((), ()))


def _fake_non_hopper(monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [_FakeGpu()])
    _ffi.local_gpus_are_hopper.cache_clear()
    _ffi.warn_no_kernel_once.cache_clear()


@pytest.fixture
def restore_device_caches():
    yield
    _ffi.local_gpus_are_hopper.cache_clear()
    _ffi.warn_no_kernel_once.cache_clear()


def _struct(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float16)


def test_auto_dispatch_never_picks_a_kernel_that_cannot_run(monkeypatch, restore_device_caches):
    """Every rule that picks the kernel (unaligned rows, f16 accumulation, fused
    activation) falls to XLA's dot on a non-Hopper GPU: the rules were measured on the
    H200, and the kernel's stand-in there (for dense, the f32-epilogue reference) is
    slower than jnp's own. Policy "kernel" still forces the primitive."""
    with jax_hopper.dispatch("auto"):
        assert jax_hopper.dispatch_path(_struct(8191, 8191), _struct(8191, 8191), NN)[0] == "kernel"  # on Hopper
    _fake_non_hopper(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with jax_hopper.dispatch("auto"):
            assert jax_hopper.dispatch_path(_struct(8191, 8191), _struct(8191, 8191), NN) == ("xla",
                                                                                            "kernel-unavailable")
            square = _problem.problem_of((8192, 8192), (8192, 8192), jnp.float16, jnp.float16, False, False)
            assert decided(square, f16_accumulation=True) == ("xla", "kernel-unavailable")
            layer = _problem.problem_of((8192, 4096), (4096, 16384), jnp.float16, jnp.float16, False, False)
            assert decided(layer, op="dense", activation="gelu_exact") == ("xla", "kernel-unavailable")
            x, w, b = _struct(8192, 4096), _struct(4096, 16384), _struct(16384)
            text = jax.jit(lambda x, w, b: jax_hopper.dense(x, w, b, activation="gelu_exact")).trace(x, w, b).lower(
                lowering_platforms=("cuda",)).as_text()
            assert "custom_call" not in text and "dot_general" in text
        with jax_hopper.dispatch("kernel"):
            assert jax_hopper.dispatch_path(_struct(64, 64), _struct(64, 64), NN) == ("kernel", "policy=kernel")
    assert [str(w.message) for w in caught if "not a Hopper" in str(w.message)], "no warning said why"


def test_auto_dispatch_without_the_built_kernel_takes_xla(monkeypatch, restore_device_caches):
    monkeypatch.setattr(_ffi, "register", lambda: False)
    _ffi.warn_no_kernel_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught, jax_hopper.dispatch("auto"):
        warnings.simplefilter("always")
        assert jax_hopper.dispatch_path(_struct(8191, 8191), _struct(8191, 8191), NN) == ("xla", "kernel-unavailable")
    assert [w for w in caught if "not built" in str(w.message)]


class _ExtensionWithDriver:
    """The compiled extension as seen under an installed driver of CUDA version `driver`."""

    def __init__(self, extension, driver):
        self._extension, self._driver = extension, driver

    def cuda_versions(self):
        return self._driver, self._extension.cuda_versions()[1]

    def __getattr__(self, name):
        return getattr(self._extension, name)


@pytest.fixture
def driver(monkeypatch):
    """Sets the driver's CUDA version the extension reports (the extension must be built)."""
    if _ffi._jax_hopper is None:
        pytest.skip("the CUDA extension is not built here")

    def use(version):
        monkeypatch.setattr(_ffi, "_jax_hopper", _ExtensionWithDriver(_ffi._jax_hopper, version))
        _ffi.driver_reason.cache_clear()
        _ffi.warn_no_kernel_once.cache_clear()
    yield use
    _ffi.driver_reason.cache_clear()
    _ffi.warn_no_kernel_once.cache_clear()


def test_a_driver_older_than_the_runtime_lowers_to_xla_with_one_warning_naming_it(driver):
    runtime = _ffi._jax_hopper.cuda_versions()[1]
    old = (runtime // 1000 - 1) * 1000 + 80  # for a CUDA 13 build: r570's CUDA 12.8, jax's CUDA 12 plugin
    driver(old)
    a, b = _struct(8191, 8191), _struct(8191, 8191)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not jax_hopper.kernel_available()
        with jax_hopper.dispatch("auto"):
            assert jax_hopper.dispatch_path(a, b, NN) == ("xla", "kernel-unavailable")
        with jax_hopper.dispatch("kernel"):
            for _ in range(2):
                text = jax.jit(jax_hopper.matmul).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call" not in text and "dot_general" in text
    msgs = [str(w.message) for w in caught if "driver" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert f"CUDA {runtime // 1000 - 1}.8" in msgs[0], msgs[0]
    assert f"CUDA {runtime // 1000}.{runtime % 1000 // 10} runtime" in msgs[0], msgs[0]


@pytest.mark.parametrize("newer", [None, 0, 20, 1000])
def test_no_driver_or_a_new_enough_one_keeps_the_kernel(driver, newer):
    """No driver (lowering for CUDA from a CPU host), or one of the runtime's major version
    or newer (minor versions are compatible within a major)."""
    major = _ffi._jax_hopper.cuda_versions()[1] // 1000 * 1000
    driver(0 if newer is None else major + newer)
    assert _ffi.driver_reason() is None and jax_hopper.kernel_available()

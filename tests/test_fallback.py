"""Where the kernel must not run: non-Hopper CUDA GPUs get XLA's dot with one warning."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp

import jax_hopper
from jax_hopper import _ffi, _primitive


class _FakeGpu:
    platform = "gpu"
    compute_capability = "8.0"


def test_non_hopper_gpu_lowers_to_xla_dot_with_one_warning(monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda *a, **k: [_FakeGpu()])
    _primitive._local_gpus_are_hopper.cache_clear()
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
        _primitive._local_gpus_are_hopper.cache_clear()
        _ffi.warn_no_kernel_once.cache_clear()

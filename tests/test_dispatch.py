"""CPU tests of the dispatcher: which path each product takes under each policy, and
that the lowering follows it (the rest of the suite forces the kernel path)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_hopper
from jax_hopper import _dispatch

TARGET = "jax_hopper_gemm"
NN = (((1,), (0,)), ((), ()))


def _structs(m, n, k, dtype=jnp.float16):
    return jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)


def _custom_calls(m, n, k, dtype=jnp.float16):
    a, b = _structs(m, n, k, dtype)
    text = jax.jit(lambda x, y: jax_hopper.matmul(x, y)).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r"stablehlo\.custom_call @(\S+)\(", text)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_auto_runs_our_kernel_only_where_a_rule_measured_it_faster(dtype):
    with jax_hopper.dispatch("auto"):
        # 8191^3: rows not 16-byte aligned, where cuBLASLt falls to its slow kernels.
        assert jax_hopper.dispatch_path(*_structs(8191, 8191, 8191, dtype), NN) == ("kernel", "unaligned-rows")
        assert _custom_calls(8191, 8191, 8191, dtype) == [TARGET]
        # Aligned: XLA's dot, lowered as jax would (no custom call of ours).
        assert jax_hopper.dispatch_path(*_structs(8192, 8192, 8192, dtype), NN) == ("xla", "default")
        assert _custom_calls(8192, 8192, 8192, dtype) == []
        # Unaligned but small: launch and padding costs dominate; XLA.
        assert jax_hopper.dispatch_path(*_structs(100, 101, 103, dtype), NN) == ("xla", "default")


def test_alignment_is_judged_on_the_stored_rows_of_each_layout():
    # NT: B is stored [N, K], so its row is K (aligned here) even though N is odd.
    nt = (((1,), (1,)), ((), ()))
    a = jax.ShapeDtypeStruct((4096, 4096), jnp.float16)
    b = jax.ShapeDtypeStruct((4095, 4096), jnp.float16)
    with jax_hopper.dispatch("auto"):
        # ... but the output row (N = 4095 f16) is not: the kernel.
        assert jax_hopper.dispatch_path(a, b, nt)[0] == "kernel"
        assert jax_hopper.dispatch_path(a, b, nt, preferred_element_type=jnp.float32)[0] == "kernel"
    p = _dispatch.problem_of((4096, 4096), (4096, 4096), jnp.float16, jnp.float16, False, True)
    assert p.rows_aligned and p.operand_rows == (4096, 4096)


def test_policies_kernel_and_xla_override_the_table():
    with jax_hopper.dispatch("kernel"):
        assert _custom_calls(8192, 8192, 8192) == [TARGET]
        with jax_hopper.dispatch("xla"):
            assert _custom_calls(8191, 8191, 8191) == []
            assert jax_hopper.dispatch_path(*_structs(8191, 8191, 8191), NN) == ("xla", "policy=xla")
        assert jax_hopper.dispatch_path(*_structs(64, 64, 64), NN) == ("kernel", "policy=kernel")


def test_ineligible_products_are_jax_whatever_the_policy():
    a = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    with jax_hopper.dispatch("kernel"):
        assert jax_hopper.dispatch_path(a, a, NN)[0] == "jax"


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="dispatch policy"):
        with jax_hopper.dispatch("fastest"):
            pass
    with pytest.raises(ValueError, match="dispatch policy"):
        jax_hopper.set_dispatch("cublas")


def test_set_dispatch_is_process_wide_and_scopes_override_it():
    before = _dispatch.current_policy()
    try:
        jax_hopper.set_dispatch("xla")
        assert _dispatch.current_policy() == "xla"
        with jax_hopper.dispatch("auto"):
            assert _dispatch.current_policy() == "auto"
        assert _dispatch.current_policy() == "xla"
    finally:
        jax_hopper.set_dispatch(before)


def test_environment_variable_sets_the_starting_policy():
    code = "import jax_hopper._dispatch as d; print(d.current_policy())"
    for policy in ("auto", "xla"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "JAX_HOPPER_DISPATCH": policy}).stdout
        assert out.strip() == policy


def test_every_rule_states_its_evidence():
    assert _dispatch.RULES[-1].applies(_dispatch.problem_of((1, 1), (1, 1), jnp.float16, jnp.float16, False,
                                                            False)), "the table must end with a catch-all"
    for rule in _dispatch.RULES:
        assert rule.path in ("kernel", "xla") and len(rule.evidence) > 20, rule

"""CPU tests of the dispatcher: which path each product takes under each policy, and
that the lowering follows it (the rest of the suite forces the kernel path)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import cuda_text, decided, kernel_ids

import jax_hopper
from jax_hopper import _dispatch, _problem, _rules

TARGET = "jax_hopper_gemm"
NN = (((1,), (0,)), ((), ()))


def _structs(m, n, k, dtype=jnp.float16):
    return jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)


def _kind_of(m, n, k, dtype=jnp.float16):
    """The kind our kernel would run jnp.dot's (m, k) @ (k, n) with."""
    return _rules.kernel_for(_problem.problem_of((m, k), (k, n), dtype, dtype, False, False))


def _custom_calls(m, n, k, dtype=jnp.float16):
    a, b = _structs(m, n, k, dtype)
    # A fresh function each time: jit caches a trace (and the path chosen in it) per function.
    text = cuda_text(lambda x, y: jax_hopper.matmul(x, y), a, b)
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
        # Unaligned but small: launch and padding costs dominate; XLA. The threshold is a
        # roofline time between the measured 1023^3 (a loss) and 1279^3 (a win, which the tile
        # bound below now leaves to XLA); decode-like products reading a large B are HBM-bound
        # and far above it.
        assert jax_hopper.dispatch_path(*_structs(100, 101, 103, dtype), NN) == ("xla", "default")
        assert jax_hopper.dispatch_path(*_structs(1023, 1023, 1023, dtype), NN) == ("xla", "default")
        assert jax_hopper.dispatch_path(*_structs(1535, 1535, 1535, dtype), NN) == ("kernel", "unaligned-rows")
        assert jax_hopper.dispatch_path(*_structs(16, 8192, 8191, dtype), NN) == ("kernel", "unaligned-rows")
        # ... but not where that weight is K-major (x @ W.T): the padding would copy it whole.
        x, w_t = jax.ShapeDtypeStruct((16, 8191), dtype), jax.ShapeDtypeStruct((8192, 8191), dtype)
        assert jax_hopper.dispatch_path(x, w_t, (((1,), (1,)), ((), ()))) == ("xla", "default")


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_unaligned_products_whose_padding_copies_outweigh_them_stay_on_xla(dtype):
    # An odd N in jnp.dot's layout leaves B's rows unaligned: the padding copies the weight
    # (read + write), about twice the product's own HBM time at small M. Measured (session
    # of 2026-12-04 14:23): 0.33-0.54x up to 128 rows, 1.06-1.12x at 256, 1.13-1.80x from 384.
    with jax_hopper.dispatch("auto"):
        for m, n, k in [(1, 50257, 768), (16, 50257, 1600), (64, 50257, 4096), (16, 32001, 4096),
                        (128, 50257, 4096), (256, 50257, 4096)]:
            assert jax_hopper.dispatch_path(*_structs(m, n, k, dtype), NN) == ("xla", "default"), (m, n, k)
        assert _custom_calls(16, 50257, 4096, dtype) == []
        for m, n, k in [(384, 50257, 4096), (1024, 50257, 4096), (16, 14336, 4095), (256, 8192, 8191)]:
            assert jax_hopper.dispatch_path(*_structs(m, n, k, dtype), NN) == ("kernel", "unaligned-rows"), (m, n, k)
        # An odd K (only A padded) over up to 256 rows, while the small-M kind's 64x128 tiles
        # fit one wave (256 of them): that kind (1.61-2.48x, where the default kernel ran
        # 0.83-1.88x; 129-256 rows since the session of 2026-12-04 16:21).
        for m, n, k in [(128, 4096, 4095), (128, 4096, 14335), (96, 4096, 8191), (65, 8192, 8191),
                        (129, 4096, 4095), (256, 4096, 4095), (192, 8192, 8191), (256, 8192, 8191),
                        (128, 14336, 4095), (192, 10240, 4095), (256, 6144, 6143)]:
            assert jax_hopper.dispatch_path(*_structs(m, n, k, dtype), NN) == ("kernel", "unaligned-rows"), (m, n, k)
            assert _kind_of(m, n, k, dtype) == "small_m", (m, n, k)
        # ... and past 256 rows with N >= 1024, K >= 2047 and 160 of its tiles (session of
        # 2026-12-04 18:24: 1.08-2.26x, where the default kernel ran 0.79-1.70x: 320-448 x
        # 3072-4096 x 4095, 640x3072x4095, 1024 / 1152 x 1536 x 4095, 1536x1024x4095,
        # 1280x1280x4095, 2048x1024 x 4095 / 2047).
        for m, n, k in [(257, 4096, 4095), (448, 3072, 4095), (1024, 1536, 4095), (1536, 1024, 4095),
                        (1280, 1280, 4095), (2048, 1024, 4095), (2048, 1024, 2047)]:
            assert jax_hopper.dispatch_path(*_structs(m, n, k, dtype), NN) == ("kernel", "unaligned-rows"), (m, n, k)
            assert _kind_of(m, n, k, dtype) == "small_m", (m, n, k)
        # Past one wave of them the default kernel (256x10240x4095 2.45x against 1.44x,
        # 160x16384x4095 2.44 / 1.41, 256x14336x4095 2.75 / 1.79; 128x28672x4095 a tie);
        # it needs 24 blocks of B's columns (N / 256), which these have, or 54 tiles
        # (1024x4096x4095: 16 blocks, 128 tiles, 2.40x; 1535^3: 6 blocks, 72 tiles, 2.70x).
        for m, n, k in [(256, 10240, 4095), (160, 16384, 4095), (256, 14336, 4095), (128, 28672, 4095),
                        (1024, 4096, 4095), (1535, 1535, 1535), (2049, 1024, 4095)]:
            assert jax_hopper.dispatch_path(*_structs(m, n, k, dtype), NN) == ("kernel", "unaligned-rows"), (m, n, k)
            assert _kind_of(m, n, k, dtype) == "persistent", (m, n, k)
        # Neither: fewer than 54 tiles on the default kernel (1280x1280x4095, 50 tiles, lost
        # 0.86x there; 1279^3, also 50, won 1.89x against XLA's slower odd-N kernel, but the
        # bound keeps to the smallest win above every loss), and not the small-M kind's: both
        # rows odd, or too few of its tiles (640x1024x8191, 80 tiles: 0.98x there;
        # 2048x512x4095, 128: 0.96-0.97x; 512x2048x8191, 128, won only 1.11-1.13x;
        # 300x2048x8191 has 80, 1152x1024x4095 and 2304x512x4095 144), or an N below the
        # measured 1024 (2048x768x4095: 192 of its tiles).
        for m, n, k in [(2304, 512, 4095), (1279, 1279, 1279), (1280, 1279, 4095), (2048, 512, 4095),
                        (640, 1024, 8191), (512, 2048, 8191), (300, 2048, 8191), (1152, 1024, 4095),
                        (2048, 768, 4095)]:
            assert jax_hopper.dispatch_path(*_structs(m, n, k, dtype), NN) == ("xla", "default"), (m, n, k)
        # A K below the measured 2047 past 256 rows: not the small-M kind (the default
        # kernel's 64 tiles take it).
        assert _kind_of(2048, 1024, 1535, dtype) == "persistent"
        # The default kernel's tile bound itself: 54 tiles won (1152x1536x4095 1.64x), 48 lost
        # (1024x1536x4095 0.79-0.82x); a fused layer runs the default kernel's tiles, so at
        # 1280x1280x4095 (50 tiles, 0.86x) it is XLA's though the plain product is ours.
        wins = _rules.unaligned_rows_win
        assert wins(_problem.Problem(0, 1152, 1536, 4095, 2, 2, False, False), "persistent")
        assert not wins(_problem.Problem(0, 1024, 1536, 4095, 2, 2, False, False), "persistent")
        p1280 = _problem.Problem(0, 1280, 1280, 4095, 2, 2, False, False)
        assert decided(p1280)[0] == "kernel" and _rules.kernel_for(p1280) == "small_m"
        assert decided(p1280, op="dense", activation=None)[0] == "xla"
        # Where the small-M kind is not compiled (here A stored [K, M], M = 255 odd; batched
        # products), the default kernel with up to 256 rows needs 24 blocks of B's columns
        # (batch x N / 256): 16 lost (256x4096x4095 0.92x, 2x100x2048x8191 0.91x), 24 won
        # (2x100x3072x8191 1.23x, 3x200x2048x4095 1.42x), 32 too (2x100x4096x4095 1.64x).
        x_t, w = jax.ShapeDtypeStruct((4096, 255), dtype), jax.ShapeDtypeStruct((4096, 4096), dtype)
        assert jax_hopper.dispatch_path(x_t, w, (((0,), (0,)), ((), ()))) == ("xla", "default")
        batched_nn = (((2,), (1,)), ((0,), (0,)))
        for b, m, n, k, path in [(2, 100, 2048, 8191, "xla"), (2, 100, 3072, 8191, "kernel"),
                                 (3, 200, 2048, 4095, "kernel"), (2, 100, 4096, 4095, "kernel")]:
            xb, wb = jax.ShapeDtypeStruct((b, m, k), dtype), jax.ShapeDtypeStruct((b, k, n), dtype)
            assert jax_hopper.dispatch_path(xb, wb, batched_nn)[0] == path, (b, m, n, k)
        # Both rows odd at 128: B would be copied (the default kernel's case): XLA.
        assert jax_hopper.dispatch_path(*_structs(128, 8191, 8191, dtype), NN) == ("xla", "default")
        # Aligned products keep the kinds they had (policy "kernel": small-M only up to 64 rows).
        assert _kind_of(128, 4096, 4096, dtype) == "persistent"
    # The copy's bytes: only the unaligned operand, at its padded length, read and written.
    p = _problem.problem_of((16, 4096), (4096, 50257), dtype, dtype, False, False)
    assert p.padding_copy_us == pytest.approx(1e6 * 2 * 4096 * 50264 * 2 / _problem.H200_PEAK_BYTES_PER_S)
    aligned = _problem.problem_of((16, 4096), (4096, 50304), dtype, dtype, False, False)
    assert aligned.padding_copy_us == 0.0
    batched_tn = _problem.Problem(3, 64, 512, 1001, 2, 2, True, False)  # A stored [K, M], B [K, N]
    assert batched_tn.padding_copy_us == 0.0  # A's rows (M = 64) and B's (N = 512) are aligned; K is outer in both
    batched_nt = _problem.Problem(3, 64, 512, 1001, 2, 2, False, True)  # both K-major, K = 1001 rows padded
    assert batched_nt.padding_copy_us == pytest.approx(1e6 * 2 * 3 * (64 + 512) * 1008 * 2 /
                                                      _problem.H200_PEAK_BYTES_PER_S)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_wide_aligned_products_run_our_kernel_only_as_measured(dtype):
    # M and N both >= 16384, K >= 4096, jnp.dot's layout: our kernel ran 0.999-1.029x
    # cuBLASLt there (_rules.WIDE_MIN_MN); with only one of them that large it tied.
    with jax_hopper.dispatch("auto"):
        # ... and LM heads (N a vocabulary) over 16384 or 32768 tokens ran 1.015-1.039x.
        for m, n, k in [(16384, 16384, 16384), (16384, 16384, 4096), (32768, 16384, 8192), (16384, 32768, 8192),
                        (16384, 128256, 4096), (16384, 50304, 4096), (32768, 32000, 4096)]:
            assert jax_hopper.dispatch_path(*_structs(m, n, k, dtype), NN) == ("kernel", "wide-aligned"), (m, n, k)
        assert _custom_calls(16384, 16384, 4096, dtype) == [TARGET]
        # With 8192 tokens the same heads tied (1.003-1.012x), as did these;
        # K below 4096 lost or tied (but for one head, 16384x128256x3072: cuBLASLt's slow pick there).
        for m, n, k in [(8192, 16384, 8192), (16384, 8192, 16384), (12288, 12288, 12288), (16384, 16384, 2048),
                        (8192, 128256, 4096), (8192, 50304, 4096), (16384, 16384, 3072), (16384, 32000, 3072)]:
            assert jax_hopper.dispatch_path(*_structs(m, n, k, dtype), NN) == ("xla", "default"), (m, n, k)
        # Not measured there: B stored [N, K], batches, f32 output, the fused dense layer.
        a = jax.ShapeDtypeStruct((16384, 8192), dtype)
        b_t = jax.ShapeDtypeStruct((16384, 8192), dtype)
        assert jax_hopper.dispatch_path(a, b_t, (((1,), (1,)), ((), ()))) == ("xla", "default")
        batched = _problem.Problem(2, 16384, 16384, 8192, 2, 2, False, False)
        assert decided(batched) == ("xla", "default")
        f32_out = _problem.problem_of((16384, 8192), (8192, 16384), dtype, jnp.float32, False, False)
        assert decided(f32_out) == ("xla", "default")
        wide = _problem.problem_of((16384, 8192), (8192, 16384), dtype, dtype, False, False)
        assert decided(wide) == ("kernel", "wide-aligned")
        assert decided(wide, op="dense", activation=None) == ("xla", "default")
        assert decided(wide, op="dense", activation="relu") == ("xla", "default")


def test_alignment_is_judged_on_the_stored_rows_of_each_layout():
    # NT: B is stored [N, K], so its row is K (aligned here) even though N is odd.
    nt = (((1,), (1,)), ((), ()))
    a = jax.ShapeDtypeStruct((4096, 4096), jnp.float16)
    b = jax.ShapeDtypeStruct((4095, 4096), jnp.float16)
    with jax_hopper.dispatch("auto"):
        # ... but the output row (N = 4095 f16) is not: the kernel.
        assert jax_hopper.dispatch_path(a, b, nt)[0] == "kernel"
        assert jax_hopper.dispatch_path(a, b, nt, preferred_element_type=jnp.float32)[0] == "kernel"
    p = _problem.problem_of((4096, 4096), (4096, 4096), jnp.float16, jnp.float16, False, True)
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


@pytest.mark.parametrize("op", _problem.OPS)
@pytest.mark.parametrize("policy", _dispatch.POLICIES)
def test_every_problem_is_decided_and_every_rule_states_its_condition(op, policy):
    """Each op has a catch-all under each policy (decide never runs off the table), and each
    kernel rule of the table names results files that back it."""
    for m, n, k in [(1, 1, 1), (8192, 8192, 8192), (16, 8191, 4095)]:
        problem = _problem.problem_of((m, k), (k, n), jnp.float16, jnp.float16, False, False, op=op,
                                      activation="gelu_exact" if op != "product" else None)
        assert _dispatch.decide(problem, policy).path in ("kernel", "xla")
    repo = pathlib.Path(__file__).resolve().parents[2]
    for rule in _rules.RULES:
        assert rule.path in ("kernel", "xla") and rule.condition, rule
        if rule.path == "kernel" and rule.policies == ("auto",):
            assert rule.evidence and all((repo / f).is_file() for f in rule.evidence), rule


LIMIT = _problem.KERNEL_MAX_DIM  # 2^31 - 1: the kernel's tile coordinates are int32


@pytest.mark.parametrize("a_shape, b_shape, fits", [
    ((LIMIT, 8), (8, 8), True),                  # M at the limit
    ((LIMIT + 1, 8), (8, 8), False),             # M past it (32 GiB of f16: an H200 holds it)
    ((2, 2**30, 8), (8, 8), False),              # leading dims folded into M past it
    ((8, LIMIT + 1), (LIMIT + 1, 8), False),     # K past it
    ((8, LIMIT), (LIMIT, 8), False),             # K at it, but A's stored rows padded past it for TMA
], ids=["M-at-limit", "M-past", "folded-M-past", "K-past", "K-padded-past"])
def test_products_past_the_kernels_limits_are_xlas_under_every_policy(a_shape, b_shape, fits):
    """cuda/gemm/gemm.cc refuses a dimension of 2^31 or more, when the program runs. XLA
    computes such products, so they are XLA's dot under every policy (dispatch_path says
    why), and each primitive bound onto our kernel directly computes them through XLA."""
    from jax_hopper._kernels import DEFAULT_KIND as DEFAULT_KERNEL
    from jax_hopper._kernels import FUSED as GEMM_FUSED_TARGET
    from jax_hopper._kernels import FUSED_DERIVATIVE as GEMM_FUSED_DERIVATIVE_TARGET
    from jax_hopper._kernels import FUSED_GRAD as GEMM_FUSED_GRAD_TARGET
    from jax_hopper.primitives.dense import fused_dense
    from jax_hopper.primitives.dense_derivative import fused_dense_with_derivative
    from jax_hopper.primitives.dense_grad import fused_activation_grad
    from jax_hopper.primitives.gemm import gemm

    f16 = jnp.float16
    a, b = jax.ShapeDtypeStruct(a_shape, f16), jax.ShapeDtypeStruct(b_shape, f16)
    dn = (((len(a_shape) - 1,), (0,)), ((), ()))
    out_shape = a_shape[:-1] + b_shape[-1:]
    g, z = jax.ShapeDtypeStruct(a_shape, f16), jax.ShapeDtypeStruct(out_shape, f16)
    w_nk = jax.ShapeDtypeStruct(b_shape[::-1], f16)  # the backward form reads w [N, K]
    with jax_hopper.dispatch("kernel"):
        assert jax_hopper.dispatch_path(a, b, dn) == (("kernel", "policy=kernel") if fits else
                                                      ("xla", _dispatch.BEYOND_KERNEL_LIMITS))
        lowered = {
            "matmul": (TARGET, cuda_text(lambda x, y: jax_hopper.matmul(x, y), a, b)),
            "dense": (GEMM_FUSED_TARGET, cuda_text(lambda x, y: jax_hopper.dense(x, y, activation="relu"), a, b)),
        }
    lowered.update({
        "gemm": (TARGET, cuda_text(lambda x, y: gemm(x, y, kernel=DEFAULT_KERNEL), a, b)),
        "fused_dense": (GEMM_FUSED_TARGET, cuda_text(lambda x, y: fused_dense(x, y, activation="silu"), a, b)),
        "with_derivative": (GEMM_FUSED_DERIVATIVE_TARGET,
                            cuda_text(lambda x, y: fused_dense_with_derivative(x, y, activation="silu"), a, b)),
        "backward_form": (GEMM_FUSED_GRAD_TARGET, cuda_text(
            lambda g, w, z: fused_activation_grad(g, w, z, activation="silu", bias_grad=True), g, w_nk, z)),
    })
    wrong = [name for name, (target, text) in lowered.items()
             if re.findall(r"stablehlo\.custom_call @(\S+)\(", text) != ([target] if fits else [])]
    assert not wrong


def _dense_problem(m, k, n, dtype=jnp.float16):
    return _problem.problem_of((m, k), (k, n), dtype, dtype, False, False)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_fused_activation_rule_covers_only_what_was_measured(dtype):
    with jax_hopper.dispatch("auto"):
        def choose(problem, activation):
            return decided(problem, op="dense", activation=activation)

        k4096 = _dense_problem(8192, 4096, 16384, dtype)
        for act in ("gelu_exact", "gelu_tanh", "silu"):  # measured ahead at K = 4096
            assert choose(k4096, act) == ("kernel", "fused-activation"), act
        assert choose(k4096, "relu") == ("xla", "default")  # cuBLASLt fuses ReLU as well: 0.94-0.96x
        assert choose(k4096, None) == ("xla", "default")
        k8192 = _dense_problem(8192, 8192, 28672, dtype)
        assert choose(k8192, "gelu_exact") == ("kernel", "fused-activation")
        assert choose(k8192, "gelu_tanh") == ("xla", "default")  # 0.995-1.004x at K = 8192
        assert choose(_dense_problem(8192, 16384, 8192, dtype), "gelu_exact") == ("xla", "default")  # K unmeasured
        # Exact GELU was measured ahead with one of M, K at 2048 too (N = 8192); not beyond.
        assert choose(_dense_problem(2048, 4096, 8192, dtype), "gelu_exact") == ("kernel", "fused-activation")
        assert choose(_dense_problem(8192, 2048, 8192, dtype), "gelu_exact") == ("kernel", "fused-activation")
        assert choose(_dense_problem(1024, 4096, 8192, dtype), "gelu_exact") == ("xla", "default")  # M smaller
        assert choose(_dense_problem(2048, 2048, 8192, dtype), "gelu_exact") == ("xla", "default")  # both small
        assert choose(_dense_problem(2048, 4096, 4096, dtype), "gelu_exact") == ("xla", "default")  # N < 8192
        assert choose(_dense_problem(8192, 4096, 2048, dtype), "gelu_exact") == ("xla", "default")  # N small
        for act in ("gelu_tanh", "silu"):
            assert choose(_dense_problem(2048, 4096, 16384, dtype), act) == ("xla", "default")  # M small
        # The plain table still applies (unaligned rows: the kernel, for any activation) ...
        assert choose(_dense_problem(8191, 4096, 8191, dtype), "relu") == ("kernel", "unaligned-rows")
        # ... for the fused kinds' 128x256 tiles, though, whatever kind the plain product
        # would run: 128 rows x 16 tiles is the class the default kernel lost (0.91x).
        odd_k = _dense_problem(128, 4095, 4096, dtype)
        assert decided(odd_k) == ("kernel", "unaligned-rows")  # the plain product: split-K kind
        assert choose(odd_k, "relu") == ("xla", "default")
        assert choose(odd_k, "gelu_exact") == ("xla", "default")
    with jax_hopper.dispatch("xla"):
        assert decided(k4096, op="dense", activation="gelu_exact") == ("xla", "policy=xla")


def test_dense_lowering_follows_the_rule_and_its_gradient_stays_16_bit():
    S = jax.ShapeDtypeStruct
    x, w, b = S((8192, 4096), jnp.float16), S((4096, 16384), jnp.float16), S((16384,), jnp.float16)

    def dense(act):
        return lambda x, w, b: jax_hopper.dense(x, w, b, activation=act)

    with jax_hopper.dispatch("auto"):
        assert re.findall(r"custom_call @(\S+)\(", cuda_text(dense("gelu_exact"), x, w, b)) == ["jax_hopper_gemm_fused"]
        assert "custom_call @jax_hopper" not in cuda_text(dense("relu"), x, w, b)
        def loss(act):
            return lambda x, w, b: jnp.sum(dense(act)(x, w, b).astype(jnp.float32) ** 2)

        # Differentiated with z kept (the saved form switched off), the fused tanh-GELU
        # saves nothing (act' needs z): jnp's computation, every product on XLA's dot
        # with a 16-bit result -- no f32 dot, which is what made the old XLA path 2x
        # slower than jnp in a training step.
        with _dispatch.saved_derivative(()):
            text = cuda_text(jax.grad(loss("gelu_tanh"), argnums=(0, 1, 2)), x, w, b)
            dots = re.findall(r"stablehlo\.dot_general.*-> tensor<([^>]*)>", text)
            assert len(dots) == 3 and all(d.endswith("xf16") for d in dots), dots
            assert "custom_call @jax_hopper" not in text
            # Only w differentiated: jnp's two products (forward, dW), no product of a zero tangent.
            text = cuda_text(jax.grad(loss("gelu_tanh"), argnums=1), x, w, b)
            assert len(re.findall(r"stablehlo\.dot_general", text)) == 2
        # By default exact GELU and tanh-GELU save act'(z) instead (one launch of the
        # derivative kind); the backward products (dx, dW) are XLA's, 16-bit.
        for act in ("gelu_exact", "gelu_tanh"):
            text = cuda_text(jax.grad(loss(act), argnums=(0, 1, 2)), x, w, b)
            assert re.findall(r"custom_call @(\S+)\(", text) == ["jax_hopper_gemm_fused_derivative"]
            dots = re.findall(r"stablehlo\.dot_general.*-> tensor<([^>]*)>", text)
            assert len(dots) == 2 and all(d.endswith("xf16") for d in dots), dots
            assert len(re.findall(r"stablehlo\.dot_general", cuda_text(jax.grad(loss(act), argnums=1), x, w,
                                                                          b))) == 1


def test_backward_products_are_dispatched_like_forward_ones():
    a, b = _structs(8192, 8192, 8192)

    def loss(x, y):
        with jax_hopper.dispatch("kernel"):  # the forward product forced onto our kernel
            c = jax_hopper.matmul(x, y)
        return jnp.sum(c.astype(jnp.float32) ** 2)

    with jax_hopper.dispatch("auto"):  # the derivative is traced here: aligned, so XLA's dot
        text = cuda_text(jax.grad(loss, argnums=(0, 1)), a, b)
    assert len(re.findall(r"custom_call @jax_hopper_gemm\(", text)) == 1
    assert len(re.findall(r"stablehlo\.dot_general", text)) == 2
    with jax_hopper.dispatch("kernel"):
        text = cuda_text(jax.grad(loss, argnums=(0, 1)), a, b)
    assert len(re.findall(r"custom_call @jax_hopper_gemm\(", text)) == 3 and "dot_general" not in text
    # Unaligned rows: the table picks our kernel for the backward products too.
    u, v = _structs(8191, 8191, 8191)
    with jax_hopper.dispatch("auto"):
        text = cuda_text(jax.grad(lambda x, y: jnp.sum(jax_hopper.matmul(x, y).astype(jnp.float32) ** 2),
                                 argnums=(0, 1)), u, v)
    assert len(re.findall(r"custom_call @jax_hopper_gemm\(", text)) == 3


def _kernel_kinds(fn, *args):
    return [int(k) for k in re.findall(r"kernel = (\d+) : i32", cuda_text(fn, *args))]


def test_decode_sized_products_run_the_small_m_kind_once_our_kernel_is_asked_for():
    KERNELS = kernel_ids()

    small, default = KERNELS["small_m"], KERNELS["persistent"]
    with jax_hopper.dispatch("kernel"):
        for m, kind in [(1, small), (16, small), (64, small), (65, default), (256, default)]:
            assert _kernel_kinds(lambda x, y: jax_hopper.matmul(x, y), *_structs(m, 8192, 8192)) == [kind], m
        assert _kernel_kinds(lambda x, y: jax_hopper.matmul(x, y), *_structs(16, 8192, 8192, jnp.bfloat16)) == [small]
        # Compiled for jnp.dot's layout only: x @ W^T and batched products keep the default kind.
        a, w_t = jax.ShapeDtypeStruct((16, 4096), jnp.float16), jax.ShapeDtypeStruct((8192, 4096), jnp.float16)
        assert _kernel_kinds(lambda x, y: x @ y.T, a, w_t) == []  # (jnp's own product: not ours)
        assert _kernel_kinds(lambda x, y: jax_hopper.dot_general(x, y, (((1,), (1,)), ((), ()))), a, w_t) == [default]
        xb, wb = jax.ShapeDtypeStruct((4, 16, 512), jnp.float16), jax.ShapeDtypeStruct((4, 512, 1024), jnp.float16)
        assert _kernel_kinds(lambda x, y: jax_hopper.matmul(x, y), xb, wb) == [default]
        # Its derivative: dx = dc w^T (NT) and dw = x^T dc (M = 8192): the default kind.
        x, w = _structs(16, 8192, 8192)
        grads = jax.grad(lambda x, w: jnp.sum(jax_hopper.matmul(x, w).astype(jnp.float32) ** 2), argnums=(0, 1))
        assert sorted(_kernel_kinds(grads, x, w)) == sorted([small, default, default])
    with jax_hopper.dispatch("auto"):  # cuBLASLt stays ahead on decode shapes: XLA's dot
        assert jax_hopper.dispatch_path(*_structs(16, 8192, 8192), NN) == ("xla", "default")


def test_vmap_of_a_decode_product_picks_the_kind_again_for_the_batched_shape():
    """kernel_for picked the small-M kind for 16 rows; vmapped over 8 activations the
    product has 128 rows (folded into M), or a batch dim with per-example weights: the
    default kind, which the small-M kind is not measured ahead of there."""
    KERNELS = kernel_ids()

    x, w = _structs(16, 8192, 8192)
    xs = jax.ShapeDtypeStruct((8, 16, 8192), jnp.float16)
    ws = jax.ShapeDtypeStruct((8, 8192, 8192), jnp.float16)
    with jax_hopper.dispatch("kernel"):
        assert _kernel_kinds(lambda x, w: jax_hopper.matmul(x, w), x, w) == [KERNELS["small_m"]]
        shared_w = jax.vmap(lambda x, w: jax_hopper.matmul(x, w), in_axes=(0, None))
        assert _kernel_kinds(shared_w, xs, w) == [KERNELS["persistent"]]
        assert _kernel_kinds(jax.vmap(lambda x, w: jax_hopper.matmul(x, w)), xs, ws) == [KERNELS["persistent"]]
        # vmap over 2 rows of 16: still decode-sized (32 rows), still the small-M kind.
        x2 = jax.ShapeDtypeStruct((2, 16, 8192), jnp.float16)
        assert _kernel_kinds(shared_w, x2, w) == [KERNELS["small_m"]]


def test_vmap_under_auto_asks_the_rules_again_for_the_batched_shape():
    """An odd-K product of 100 rows runs the small-M kind (2.07-2.48x measured at 96-128
    rows); vmapped over two per-example weights of 2048 columns it would be a batched
    default kernel with 16 blocks of B's columns, which lost (2x100x2048x8191, 0.91x):
    XLA's dot. Vmapped over the activations only, it is one product of 200 rows, which
    the rules take (the small-M kind). Policy "kernel" still runs ours."""
    KERNELS = kernel_ids()

    x, w = _structs(100, 2048, 8191)
    xs = jax.ShapeDtypeStruct((2, 100, 8191), jnp.float16)
    ws = jax.ShapeDtypeStruct((2, 8191, 2048), jnp.float16)
    product = lambda x, w: jax_hopper.matmul(x, w)  # noqa: E731
    with jax_hopper.dispatch("auto"):
        assert _kernel_kinds(product, x, w) == [KERNELS["small_m"]]
        assert _kernel_kinds(jax.vmap(product), xs, ws) == []
        assert "dot_general" in cuda_text(jax.vmap(product), xs, ws)
        assert _kernel_kinds(jax.vmap(product, in_axes=(0, None)), xs, w) == [KERNELS["small_m"]]
        # ... and so does its training step: unbatched the forward product is ours (its
        # derivatives, x @ W.T-like with an odd K to copy and 100-row ones, are XLA's);
        # vmapped over per-example weights none is.
        loss = lambda x, w: jnp.sum(product(x, w).astype(jnp.float32) ** 2)  # noqa: E731
        grads = jax.grad(loss, argnums=(0, 1))
        assert _kernel_kinds(grads, x, w) == [KERNELS["small_m"]]
        assert _kernel_kinds(jax.vmap(grads), xs, ws) == []
        # With 4096 columns per example (32 blocks) the batched product is ours: 1.64x.
        xs4, ws4 = jax.ShapeDtypeStruct((2, 100, 4095), jnp.float16), jax.ShapeDtypeStruct((2, 4095, 4096), jnp.float16)
        assert _kernel_kinds(jax.vmap(product), xs4, ws4) == [KERNELS["persistent"]]
    with jax_hopper.dispatch("kernel"):
        assert _kernel_kinds(jax.vmap(product), xs, ws) == [KERNELS["persistent"]]


def test_vmap_asks_again_only_what_the_rules_picked():
    """The mark travels with the traced product, not with the policy when vmap runs: a
    product traced under policy "kernel" (a jaxpr kept from then) keeps our kernel when
    vmapped later under "auto", and a kind asked for by name is kept; nested vmaps ask again at each level;
    the f16-accumulating kind, picked under "auto" for one product, is asked again too."""
    from jax.extend.core import jaxpr_as_fun

    from jax_hopper.primitives.gemm import gemm
    KERNELS = kernel_ids()

    xs = jax.ShapeDtypeStruct((2, 100, 8191), jnp.float16)
    ws = jax.ShapeDtypeStruct((2, 8191, 2048), jnp.float16)
    product = lambda x, w: jax_hopper.matmul(x, w)  # noqa: E731
    with jax_hopper.dispatch("kernel"):  # traced under "kernel", kept as a jaxpr (jit would trace again)
        traced = jaxpr_as_fun(jax.make_jaxpr(product)(*[jax.ShapeDtypeStruct(s.shape[1:], s.dtype) for s in (xs, ws)]))
    with jax_hopper.dispatch("auto"):
        assert _kernel_kinds(jax.vmap(traced), xs, ws) == [KERNELS["persistent"]]
        assert _kernel_kinds(jax.vmap(product), xs, ws) == []  # traced under "auto": the rules
        by_name = jax.vmap(lambda x, w: gemm(x, w, kernel="persistent"))
        assert _kernel_kinds(by_name, xs, ws) == [KERNELS["persistent"]]
        # Nested: 2 examples x 8 blocks lost (XLA); 4 x 8 = 32 blocks is ours again.
        xss = jax.ShapeDtypeStruct((2,) + xs.shape, jnp.float16)
        wss = jax.ShapeDtypeStruct((2,) + ws.shape, jnp.float16)
        assert _kernel_kinds(jax.vmap(jax.vmap(product)), xss, wss) == [KERNELS["persistent"]]
        # accumulation="f16" is measured ahead on one product only (f16_accumulation_wins).
        x, w = _structs(8192, 8192, 8192)
        f16 = lambda x, w: jax_hopper.matmul(x, w, accumulation="f16")  # noqa: E731
        assert _kernel_kinds(f16, x, w) == [KERNELS["persistent_f16acc"]]
        x2, w2 = (jax.ShapeDtypeStruct((2,) + s.shape, s.dtype) for s in (x, w))
        assert _kernel_kinds(jax.vmap(f16), x2, w2) == []
    with jax_hopper.dispatch("kernel"):
        assert _kernel_kinds(jax.vmap(f16), x2, w2) == [KERNELS["persistent_f16acc"]]


# The benchmark's raw results for unaligned products since the session of 2026-12-04
# 02:44 (`--l2 cold`; device code as at 8f0e228): kernel time of the kinds forced and of
# the default path, each against jnp.dot in the same process.
RESULTS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results" / "evidence"
_LAYOUT_FLAGS = {"nn": (False, False), "nt": (False, True), "tn": (True, False), "tt": (True, True)}
_FORCED_KIND = {"kernel": "persistent", "kernel small_m": "small_m", "small_m": "small_m", "persistent": "persistent"}


# Before rows named their kind (the session of 2026-12-04 18:24), "auto" sent the small-M
# kind products of up to this many rows; past it, its kernel path ran the default kind.
_SMALL_M_ROWS_BEFORE_KIND_RECORDED = 256


def _measured_kind(row):
    """The kind a recorded row ran (None where the row does not say)."""
    if row.get("kind"):
        return row["kind"]
    if row["variant"] in _FORCED_KIND:
        return _FORCED_KIND[row["variant"]]
    if row["variant"] == "jax_hopper" and row["path"] == "kernel" and (
            row["batch"] or row["layout"] != "nn" or row["m"] > _SMALL_M_ROWS_BEFORE_KIND_RECORDED):
        return "persistent"  # only the default kind ran these (the small-M kind: unbatched NN, <= 256 rows)
    return None


def test_the_rules_send_no_recorded_loss_to_our_kernel():
    """Every recorded product that the rules now send to our kernel, with the kind that
    kernel_for now picks, ran at least as fast as jnp.dot there by kernel time; so every
    recorded loss (odd vocabularies at decode sizes 0.33-0.66x, few B blocks 0.83-0.93x)
    goes elsewhere. Guards a rule change against the measurements it must keep honouring."""
    if not jax_hopper.kernel_available():
        pytest.skip("the rules only send products to our kernel where it is built")
    checked = []
    for path in sorted(RESULTS.glob("unaligned_*.json")):
        results = json.loads(path.read_text())
        if results["meta"]["protocol"].get("kernel_time_l2") != "cold":
            continue  # earlier device code, L2 warm
        for row in results["rows"]:
            kind = _measured_kind(row)
            if kind is None:
                continue
            ta, tb = _LAYOUT_FLAGS[row["layout"]]
            problem = _problem.Problem(row["batch"], row["m"], row["n"], row["k"], 2, 2, ta, tb)
            if decided(problem, "auto")[0] == "kernel" and _rules.kernel_for(problem) == kind:
                checked.append((path.name, row["variant"], row["batch"], row["m"], row["n"], row["k"], row["dtype"]))
                assert row["kernel_ratio_vs_jnp"] >= 1.0, checked[-1]
    assert len(checked) >= 50, checked  # the recorded wins are still taken (36 at 0c3f06c, 57 since 18:24)


def test_a_trace_made_under_one_policy_is_not_reused_under_another(monkeypatch):
    """The policy is in jax's trace context: jit's cache, jax.checkpoint's and a jitted
    function's derivative are traced again under another policy. (With a context variable,
    jax.checkpoint replayed an "auto" trace -- XLA's dot -- inside dispatch("kernel").)"""
    from jax_hopper.primitives import gemm
    binds = []
    bind = gemm.gemm_p.bind
    monkeypatch.setattr(gemm.gemm_p, "bind", lambda *a, **k: binds.append(1) or bind(*a, **k))
    a = jnp.ones((3, 64, 64), jnp.float16)
    b = jnp.ones((64, 64), jnp.float16)

    def ours_under(policy, fn, *args):
        binds.clear()
        with jax_hopper.dispatch(policy) if policy else contextlib.nullcontext():
            jax.block_until_ready(fn(*args))
        return len(binds)

    product = jax.jit(jax_hopper.matmul)
    assert ours_under("xla", product, a, b) == 0 and ours_under("kernel", product, a, b) > 0

    remat = jax.checkpoint(lambda x, y: jax_hopper.dot_general(x, y, NN))
    with jax_hopper.dispatch("xla"):
        jax.eval_shape(remat, b, b)  # traced under "xla" first
    assert ours_under("kernel", jax.jit(jax.vmap(remat, in_axes=(0, None))), a, b) > 0

    loss = jax.jit(lambda x, y: jnp.sum(jax_hopper.matmul(x, y).astype(jnp.float32)))
    grad = jax.grad(loss, argnums=(0, 1))
    assert ours_under("xla", grad, a, b) == 0
    assert ours_under("kernel", grad, a, b) >= 3  # the forward product and both backward ones

    assert ours_under("xla", product, a, b) == 0  # and back

    before = _dispatch.current_policy()  # the option is jax's: jax.config.update sets it too
    try:
        jax.config.update("jax_hopper_dispatch", "xla")
        assert _dispatch.current_policy() == "xla" and ours_under(None, product, a, b) == 0
    finally:
        jax_hopper.set_dispatch(before)


def test_the_saved_derivative_override_is_in_the_trace_key():
    """The benchmark's and tests' saved-derivative scope is read while jax traces and is in
    jax's jit key: a jitted function is traced once per override, then reused."""
    seen = []
    f = jax.jit(lambda x: (seen.append(_dispatch.may_save_derivative("relu")), x)[1])
    f(1.0)
    with _dispatch.saved_derivative({"relu"}):
        f(1.0)
        f(1.0)
    f(1.0)
    assert seen == [False, True]

"""GPU reliability (Hopper only; skipped with a reason elsewhere): special values,
determinism, sizes past 2^31 elements, concurrency and control flow, a stress run."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import f32_reference, kernel_ids, relative_error, seed_normal

import jax_hopper

KERNELS = kernel_ids()

F16 = jnp.float16


def _inputs(m, n, k, dtype=F16, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    return seed_normal(ka, (m, k), dtype, k), seed_normal(kb, (k, n), dtype, k)


@pytest.mark.parametrize("shape", [(256, 512, 128), (129, 257, 72), (100, 101, 103)],
                         ids=lambda s: "x".join(map(str, s)))
def test_nan_and_inf_land_where_jnp_dot_puts_them(hopper, shape):
    m, n, k = shape
    a, b = _inputs(m, n, k, seed=1)
    a = a.at[3, 5].set(jnp.nan).at[7, 0].set(jnp.inf)
    b = b.at[2, 9].set(-jnp.inf).at[k - 1, n - 1].set(jnp.nan)
    ours = np.asarray(jax.jit(jax_hopper.matmul)(a, b).astype(jnp.float32))
    ref = np.asarray(jnp.dot(a, b).astype(jnp.float32))
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(ours), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(ref))


def _digest(x) -> str:
    return hashlib.sha256(np.asarray(x.astype(jnp.float32)).tobytes()).hexdigest()


def test_bitwise_identical_across_calls_and_processes(hopper):
    a, b = _inputs(2000, 3000, 1000, seed=2)
    here = _digest(jax.jit(jax_hopper.matmul)(a, b))
    code = textwrap.dedent("""
        import hashlib, jax, jax.numpy as jnp, numpy as np, jax_hopper
        ka, kb = jax.random.split(jax.random.key(2))
        a = (jax.random.normal(ka, (2000, 1000), jnp.float32) / 1000**0.25).astype(jnp.float16)
        b = (jax.random.normal(kb, (1000, 3000), jnp.float32) / 1000**0.25).astype(jnp.float16)
        c = jax.jit(jax_hopper.matmul)(a, b)
        print(hashlib.sha256(np.asarray(c.astype(jnp.float32)).tobytes()).hexdigest())
    """)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # this process holds the pool
    other = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd="/",
                           env=env).stdout.split()[-1]
    assert other == here


def test_concurrent_calls_from_threads_match_serial_results(hopper):
    f = jax.jit(jax_hopper.matmul)
    inputs = [_inputs(1024, 1024, 512 + 64 * i, seed=10 + i) for i in range(8)]
    serial = [_digest(f(a, b)) for a, b in inputs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(3):
            parallel = list(pool.map(lambda ab: _digest(f(*ab)), inputs))
            assert parallel == serial


def test_inside_scan_and_while_loop(hopper):
    a, b = _inputs(512, 512, 512, seed=3)

    def step(c, _):
        return jax_hopper.matmul(c, b), None

    scanned, _ = jax.jit(lambda c: jax.lax.scan(step, c, None, length=3))(a)
    looped = jax.jit(lambda c: jax.lax.fori_loop(0, 3, lambda i, x: jax_hopper.matmul(x, b), c))(a)
    ref = a
    for _ in range(3):
        ref = jnp.dot(ref, b)
    np.testing.assert_array_equal(np.asarray(scanned.astype(jnp.float32)), np.asarray(looped.astype(jnp.float32)))
    assert relative_error(scanned, ref.astype(jnp.float32)) < 1e-2  # three chained f16 products


@pytest.mark.parametrize("shape", [(524352, 256, 4096), (46400, 46400, 64)], ids=["A>2^31", "C>2^31"])
def test_operands_past_2_31_elements(hopper, shape):
    m, n, k = shape
    assert max(m * k, m * n) > 2**31
    a, b = _inputs(m, n, k, seed=4)
    out = jax.jit(jax_hopper.matmul)(a, b)
    ref = f32_reference(a, b)
    err, err_jnp = relative_error(out, ref), relative_error(jnp.dot(a, b), ref)
    assert err <= 1.5 * err_jnp, f"{err:.3e} vs {err_jnp:.3e}"
    # The last rows are the ones a 32-bit offset would get wrong.
    tail = slice(m - 3, m)
    np.testing.assert_allclose(np.asarray(out[tail].astype(jnp.float32)), np.asarray(ref[tail]), rtol=0.02, atol=0.02)


def test_stress_random_shapes_and_layouts_no_errors_no_memory_growth(hopper):
    rng = np.random.default_rng(0)
    cases = []
    for i in range(24):
        m, n, k = (int(x) for x in rng.integers(1, 700, size=3))
        layout = i % 4
        dims = [(((1,), (0,)), ((), ())), (((1,), (1,)), ((), ())), (((0,), (0,)), ((), ())),
                (((0,), (1,)), ((), ()))][layout]
        a_shape = (k, m) if layout in (2, 3) else (m, k)
        b_shape = (n, k) if layout in (1, 3) else (k, n)
        dtype = [jnp.float16, jnp.bfloat16][i % 2]
        ka, kb = jax.random.split(jax.random.key(i))
        a = jax.random.normal(ka, a_shape, jnp.float32).astype(dtype)
        b = jax.random.normal(kb, b_shape, jnp.float32).astype(dtype)
        f = jax.jit(lambda x, y, d=dims: jax_hopper.dot_general(x, y, d))
        ref = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims, precision="highest")
        cases.append((f, a, b, ref))
    # Warm up everything the loop runs, its correctness checks included: compiling them
    # later would allocate executables' device buffers and read as growth.
    for f, a, b, ref in cases:
        assert relative_error(f(a, b), ref) < 1e-2
    # Steady state: a leak grows with the number of calls, so compare after the first
    # quarter of the calls (one-time allocations of jax's own caches and pools are made
    # by then) with the end, 1800 calls later.
    device = jax.devices("cuda")[0]
    before = None
    for rep in range(100):  # 2400 calls
        outs = [f(a, b) for f, a, b, _ in cases]
        jax.block_until_ready(outs)
        if rep % 25 == 0:
            for (_, _, _, ref), out in zip(cases, outs):
                assert relative_error(out, ref) < 1e-2
        del outs
        if rep == 24:
            before = device.memory_stats()["bytes_in_use"]
    after = device.memory_stats()["bytes_in_use"]
    assert after <= before + 1024, f"device memory grew by {after - before} bytes"


BF16 = jnp.bfloat16
# Every handler's last result: its workspace (more than these products need).
WORKSPACE = jax.ShapeDtypeStruct((1 << 20,), jnp.uint8)

FFI_MISUSE = [  # (a, b, c shape, c dtype, attributes, message)
    ((64, 32), (48, 64), (64, 64), F16, {}, "inconsistent shapes"),
    ((64, 32), (32, 64), (65, 64), F16, {}, "inconsistent shapes"),
    # K may differ only by the K-major operand's row padding: the other one (K outer)
    # stored up to 7 rows shorter. Longer, 8 short, or both K-outer is refused.
    ((64, 32), (33, 64), (64, 64), F16, {}, "inconsistent shapes"),
    ((64, 40), (32, 64), (64, 64), F16, {}, "inconsistent shapes"),
    ((32, 64), (31, 64), (64, 64), F16, {"transpose_a": 1}, "inconsistent shapes"),
    ((64, 12), (12, 64), (64, 64), F16, {}, "not a multiple of 8"),
    ((2, 64, 32), (32, 64, 1), (64, 64), F16, {}, "rank"),
    # A [..., M, K] against a 2-D B folds its leading dims into M; C must keep them.
    ((2, 64, 32), (32, 64), (64, 64), F16, {}, "needs c"),
    ((2, 64, 32), (32, 64), (2, 65, 64), F16, {}, "needs c"),
    ((2, 32, 64), (32, 64), (2, 64, 64), F16, {"transpose_a": 1}, "transpose_a=0"),
    ((2, 64, 32), (3, 32, 64), (2, 64, 64), F16, {}, "batch sizes differ"),
    ((64, 32), (32, 64), (64, 64), BF16, {}, "c must have"),
    ((64, 32), (32, 64), (64, 64), F16, {"kernel": 5}, "unknown kernel"),  # the fused kind: its own handler
    ((64, 32), (32, 64), (64, 64), F16, {"kernel": max(KERNELS.values()) + 1}, "unknown kernel"),  # past the last
    ((64, 32), (32, 64), (64, 64), F16, {"stages": 5}, "no compiled"),
]


@pytest.mark.parametrize("a_shape,b_shape,c_shape,c_dtype,attrs,match", FFI_MISUSE,
                         ids=[m[-1].replace(" ", "_") for m in FFI_MISUSE])
def test_ffi_handler_rejects_inconsistent_calls(hopper, a_shape, b_shape, c_shape, c_dtype, attrs, match):
    """The handler re-checks what it is handed, whoever calls it (here: ffi_call directly,
    bypassing the Python checks), and answers with an error instead of reading or writing
    out of bounds."""
    params = {"transpose_a": np.int32(0), "transpose_b": np.int32(0), "kernel": np.int32(1), "stages": np.int32(4)}
    params.update({k: np.int32(v) for k, v in attrs.items()})
    a, b = jnp.ones(a_shape, F16), jnp.ones(b_shape, F16)
    call = jax.ffi.ffi_call(jax_hopper.GEMM_TARGET, (jax.ShapeDtypeStruct(c_shape, c_dtype), WORKSPACE))
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(jax.jit(lambda x, y: call(x, y, **params))(a, b))


def _direct_gemm(a, b, kernel, workspace_bytes):
    """jax_hopper_gemm called directly with a workspace of this size."""
    params = {"transpose_a": np.int32(0), "transpose_b": np.int32(0),
              "kernel": np.int32(KERNELS[kernel]), "stages": np.int32(4)}
    call = jax.ffi.ffi_call(jax_hopper.GEMM_TARGET, (jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), F16),
                                                     jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8)))
    return jax.jit(lambda x, y: call(x, y, **params)[0])(a, b)


def test_a_workspace_without_room_for_the_ticket_counter_is_an_error(hopper):
    a, b = _inputs(4160, 4096, 64, seed=4)  # 66 x 16 tiles: more than one wave takes tickets
    with pytest.raises(Exception, match="ticket counter needs 16"):
        jax.block_until_ready(_direct_gemm(a, b, "persistent", 8))


def test_split_k_fits_its_pieces_into_a_smaller_workspace(hopper):
    """A workspace planned for fewer SMs (an exported program on a larger GPU): split K cuts
    fewer pieces, here none, and the product is still right."""
    a, b = _inputs(16, 1024, 8192, seed=5)  # 8 tiles, cut into more pieces than a cluster holds
    for size in (0, 4096):
        c = _direct_gemm(a, b, "small_m", size)
        assert relative_error(c, f32_reference(a, b)) < 1e-3

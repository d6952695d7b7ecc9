"""The tensor-parallel products (jax_hopper.collective) on 2, 4 and 8 CPU devices, inside
shard_map: values and gradients against a float64 reference of the unsharded product,
within the rounding their arithmetic allows; odd sizes that do not split into chunks;
and their lowering for CUDA (a ring of our products and collective-permutes)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cuda_text
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from ragged_cases import assert_within_rounding

import jax_hopper
from jax_hopper import collective

DTYPES = [jnp.float16, jnp.bfloat16]


def _mesh(devices):
    cpus = jax.devices("cpu")
    if len(cpus) < devices:
        pytest.skip(f"needs {devices} CPU devices (jax_num_cpu_devices)")
    return jax.make_mesh((devices,), ("x",), axis_types=(AxisType.Auto,), devices=cpus[:devices])


def _normal(seed, shape, dtype):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _reference(a, b):
    """a @ b in float64, and sum |a||b| (the rounding bound's scale)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a64 @ b64, np.abs(a64) @ np.abs(b64)


def _sharded(fn, mesh, in_specs, out_spec):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec))


# (devices, rows per device, K, columns per device, chunks): chunks of 5 rows in 3 and
# of 3 rows in 4 pieces do not divide evenly (4 pieces of 3 rows: 3 pieces of 1).
CASES = [(2, 5, 24, 16, 1), (2, 5, 24, 16, 3), (4, 6, 40, 8, 2), (8, 3, 16, 24, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("devices, m, k, n, chunks", CASES)
def test_all_gather_matmul(devices, m, k, n, chunks, dtype):
    """x's rows and w's columns sharded: every device gets all rows times its columns;
    the gradients are those of the whole product (d x from a reduce-scatter ring, d w
    from the gathered rows), each one f32 sum rounded once."""
    mesh = _mesh(devices)
    x, w = _normal(1, (devices * m, k), dtype), _normal(2, (k, devices * n), dtype)
    ct = _normal(3, (devices * m, devices * n), dtype)
    f = _sharded(functools.partial(collective.all_gather_matmul, axis_name="x", chunks=chunks), mesh,
                 (P("x", None), P(None, "x")), P(None, "x"))
    out, vjp = jax.vjp(f, x, w)
    ref, mag = _reference(x, w)
    assert out.dtype == dtype
    assert_within_rounding(out, ref, mag, k)
    dx, dw = vjp(ct)
    ref, mag = _reference(ct, np.asarray(w).T)
    assert_within_rounding(dx, ref, mag, devices * n)
    ref, mag = _reference(np.asarray(x).T, ct)
    assert_within_rounding(dw, ref, mag, devices * m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("devices, m, k, n, chunks", CASES)
def test_matmul_reduce_scatter(devices, m, k, n, chunks, dtype):
    """The contraction sharded (h's columns, w's rows): each device gets its block of
    the rows of the summed product, f32 across devices and rounded once; d h is an
    all-gather-matmul, d w a ring over the gathered cotangent."""
    mesh = _mesh(devices)
    h, w = _normal(4, (devices * m, devices * k), dtype), _normal(5, (devices * k, n), dtype)
    ct = _normal(6, (devices * m, n), dtype)
    f = _sharded(functools.partial(collective.matmul_reduce_scatter, axis_name="x", chunks=chunks), mesh,
                 (P(None, "x"), P("x", None)), P("x", None))
    out, vjp = jax.vjp(f, h, w)
    ref, mag = _reference(h, w)
    assert out.dtype == dtype
    assert_within_rounding(out, ref, mag, devices * k)
    dh, dw = vjp(ct)
    ref, mag = _reference(ct, np.asarray(w).T)
    assert_within_rounding(dh, ref, mag, n)
    ref, mag = _reference(np.asarray(h).T, ct)
    assert_within_rounding(dw, ref, mag, devices * m)


def test_f32_results():
    mesh = _mesh(4)
    x, w = _normal(7, (4 * 6, 32), jnp.bfloat16), _normal(8, (32, 4 * 8), jnp.bfloat16)
    f = _sharded(functools.partial(collective.all_gather_matmul, axis_name="x", preferred_element_type=jnp.float32),
                 mesh, (P("x", None), P(None, "x")), P(None, "x"))
    out = f(x, w)
    ref, mag = _reference(x, w)
    assert out.dtype == jnp.float32
    assert_within_rounding(out, ref, mag, 32)


@pytest.mark.parametrize("devices", [2, 4, 8])
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_sequence_parallel_mlp(devices, activation):
    """The MLP block with tokens sharded: the same values and parameter gradients as the
    unsharded block with the kernel's arithmetic (f32 products and epilogues, each rounded
    once), within the rounding of the hidden activations."""
    from jax_hopper._reference import ACTIVATION_FNS

    mesh = _mesh(devices)
    t, d, hdim = 4 * devices, 32, 16 * devices
    x = _normal(9, (t, d), jnp.bfloat16)
    w1, b1 = _normal(10, (d, hdim), jnp.bfloat16) / 4, _normal(11, (hdim,), jnp.bfloat16)
    w2, b2 = _normal(12, (hdim, d), jnp.bfloat16) / 4, _normal(13, (d,), jnp.bfloat16)
    block = _sharded(functools.partial(collective.sequence_parallel_mlp, axis_name="x", activation=activation,
                                       chunks=2),
                     mesh, (P("x", None), P(None, "x"), P("x"), P("x", None), P()), P("x", None))

    def unsharded(x, w1, b1, w2, b2):
        z = jnp.dot(x, w1, preferred_element_type=jnp.float32) + b1.astype(jnp.float32)
        hidden = ACTIVATION_FNS[activation](z).astype(x.dtype)
        y = jnp.dot(hidden, w2, preferred_element_type=jnp.float32) + b2.astype(jnp.float32) + x.astype(jnp.float32)
        return y.astype(x.dtype)

    out = block(x, w1, b1, w2, b2)
    expected = jax.jit(unsharded)(x, w1, b1, w2, b2)
    # The hidden activations may round differently (the sums' order): a bf16 ulp of a
    # hidden value times |w2| per term, then the output's own rounding.
    hidden_ulp = 2.0 ** -7
    z64 = np.asarray(x, np.float64) @ np.asarray(w1, np.float64) + np.asarray(b1, np.float64)
    slack = hidden_ulp * (np.abs(z64) + 1) @ np.abs(np.asarray(w2, np.float64))
    diff = np.abs(np.asarray(out, np.float64) - np.asarray(expected, np.float64))
    bound = slack + 2.0 ** -7 * np.abs(np.asarray(expected, np.float64)) + 1e-6
    assert (diff <= bound).all(), float((diff - bound).max())

    def loss(fn):
        return lambda *p: jnp.sum(fn(*p).astype(jnp.float32) ** 2)

    got = jax.grad(loss(block), argnums=(1, 2, 3, 4))(x, w1, b1, w2, b2)
    want = jax.jit(jax.grad(loss(unsharded), argnums=(1, 2, 3, 4)))(x, w1, b1, w2, b2)
    for g, e in zip(got, want):
        g64, e64 = np.asarray(g, np.float64), np.asarray(e, np.float64)
        assert g.shape == e.shape and g.dtype == e.dtype
        scale = np.abs(e64).max()
        assert np.abs(g64 - e64).max() <= 0.05 * scale, (np.abs(g64 - e64).max(), scale)


def test_sequence_parallel_mlp_from_whole_arrays_under_jit():
    """With `mesh`, the block takes whole arrays under jit (here unsharded ones, which it
    shards itself) and returns the tokens sharded over the axis: the same values as the
    block run inside a shard_map by hand."""
    mesh = _mesh(4)
    x = _normal(20, (16, 32), jnp.float16)
    w1, b1 = _normal(21, (32, 64), jnp.float16) / 4, _normal(22, (64,), jnp.float16)
    w2, b2 = _normal(23, (64, 32), jnp.float16) / 4, _normal(24, (32,), jnp.float16)
    whole = jax.jit(functools.partial(collective.sequence_parallel_mlp, axis_name="x", mesh=mesh, activation="silu"))
    by_hand = _sharded(functools.partial(collective.sequence_parallel_mlp, axis_name="x", activation="silu"), mesh,
                       (P("x", None), P(None, "x"), P("x"), P("x", None), P()), P("x", None))
    out = whole(x, w1, b1, w2, b2)
    assert out.sharding.spec[0] == "x"
    assert bool((out == by_hand(x, w1, b1, w2, b2)).all())


def test_errors_name_the_problem():
    mesh = _mesh(2)
    h, w = _normal(14, (5, 8), jnp.float16), _normal(15, (8, 4), jnp.float16)
    f = _sharded(functools.partial(collective.matmul_reduce_scatter, axis_name="x"), mesh,
                 (P(None, "x"), P("x", None)), P("x", None))
    with pytest.raises(ValueError, match="5 rows do not split over 2 devices"):
        f(h, w)
    g = _sharded(functools.partial(collective.all_gather_matmul, axis_name="x", chunks=0), mesh,
                 (P("x", None), P(None, "x")), P(None, "x"))
    with pytest.raises(ValueError, match="chunks must be at least 1"):
        g(_normal(16, (4, 8), jnp.float16), _normal(17, (8, 4), jnp.float16))


@pytest.mark.parametrize("devices", [2, 4])
def test_each_ring_step_is_our_product_beside_a_transfer(devices):
    """Lowered for CUDA under policy "kernel": one of our products per ring step (a chunk
    each) and P - 1 collective-permutes, none of them an all-gather or a reduce-scatter."""
    mesh = _mesh(devices)
    x = jax.ShapeDtypeStruct((devices * 128, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, devices * 256), jnp.bfloat16)
    ag = jax.shard_map(functools.partial(collective.all_gather_matmul, axis_name="x", chunks=2), mesh=mesh,
                       in_specs=(P("x", None), P(None, "x")), out_specs=P(None, "x"))
    with jax_hopper.dispatch("kernel"):
        text = cuda_text(ag, x, w)
    assert text.count(f"@{jax_hopper.GEMM_TARGET}(") == 2 * devices, text
    assert text.count("stablehlo.collective_permute") == devices - 1
    assert "stablehlo.all_gather" not in text and "stablehlo.reduce_scatter" not in text

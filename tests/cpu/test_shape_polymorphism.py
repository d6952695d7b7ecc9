"""Shape polymorphism (jax.export with symbolic dims): our ops export like jnp's.

The dispatcher's rules and the kernel's launch need sizes, so a product with a symbolic
dim is jax's own computation, and a vmap over a symbolic size takes the primitives'
reference arithmetic. Each exported function is called at two sizes and compared with
jnp: products against the f32 reference (helpers.assert_same_product's rounding bound),
dense and mlp layers bit for bit against the same layer written in jnp and exported the
same way (it is the same computation), the vmapped fused layer under policy "kernel"
against the f32 reference of its arithmetic, rounded once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_product, relative_error, seed_normal, slow
from jax import export

import jax_hopper

POLICIES = ["auto", "kernel"]
SIZES = (5, 17)  # the symbolic dim's values at call time
NN = (((1,), (0,)), ((), ()))
BATCHED = (((2,), (1,)), ((0,), (0,)))
ERROR_FACTOR = 1.5  # as test_dense: 1.5x the error of rounding the f32 reference itself
F32_ACT = {None: lambda z: z, "gelu_tanh": jax.nn.gelu, "gelu_exact": lambda z: jax.nn.gelu(z, approximate=False),
           "silu": jax.nn.silu}


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _exported(fn, policy, *specs):
    with jax_hopper.dispatch(policy):
        return export.export(jax.jit(fn))(*specs)


def _product_cases(dtype):
    """(name, our fn, jnp's fn, lhs spec, rhs spec, concrete shapes for a size, dimension numbers)."""
    b, k = export.symbolic_shape("b, k")
    return [
        ("matmul-M", jax_hopper.matmul, jnp.matmul, _spec((b, 64), dtype), _spec((64, 48), dtype),
         lambda s: ((s, 64), (64, 48)), NN),
        ("dot-K", jax_hopper.dot, jnp.dot, _spec((24, k), dtype), _spec((k, 40), dtype),
         lambda s: ((24, s), (s, 40)), NN),
        ("dot_general-M", lambda x, y: jax_hopper.dot_general(x, y, NN), lambda x, y: jax.lax.dot_general(x, y, NN),
         _spec((b, 32), dtype), _spec((32, 16), dtype), lambda s: ((s, 32), (32, 16)), NN),
        ("matmul-batch", jax_hopper.matmul, jnp.matmul, _spec((b, 8, 32), dtype), _spec((b, 32, 16), dtype),
         lambda s: ((s, 8, 32), (s, 32, 16)), BATCHED),
    ]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_products_with_a_symbolic_dim_export_and_run_like_jnp(policy, dtype):
    for name, ours, theirs, a_spec, b_spec, shapes, dims in _product_cases(dtype):
        exp = _exported(ours, policy, a_spec, b_spec)
        assert exp.out_avals == export.export(jax.jit(theirs))(a_spec, b_spec).out_avals, name
        for seed, size in enumerate(SIZES):
            a_shape, b_shape = shapes(size)
            ka, kb = jax.random.split(jax.random.key(seed))
            k = a_shape[-1]
            a, b = seed_normal(ka, a_shape, dtype, k), seed_normal(kb, b_shape, dtype, k)
            assert_same_product(exp.call(a, b), theirs(a, b), a, b, dims)


def _layer_operands(lead, d, f, dtype, seed):
    kx, k1, kb1, k2 = jax.random.split(jax.random.key(seed), 4)
    return (seed_normal(kx, tuple(lead) + (d,), dtype, d), seed_normal(k1, (d, f), dtype, d),
            jax.random.normal(kb1, (f,), jnp.float32).astype(dtype), seed_normal(k2, (f, d), dtype, f))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("activation", ["gelu_exact", slow("gelu_tanh"), slow("silu")])
def test_dense_and_mlp_with_a_symbolic_dim_are_jnps_layers(policy, activation):
    act = F32_ACT[activation]
    b, = export.symbolic_shape("b")
    dtype, d, f = jnp.float16, 32, 64
    specs = (_spec((b, d), dtype), _spec((d, f), dtype), _spec((f,), dtype), _spec((f, d), dtype))
    layers = {  # ours, and the same layer as a jnp user writes it
        "dense": (lambda x, w1, b1, w2: jax_hopper.dense(x, w1, b1, activation=activation),
                  lambda x, w1, b1, w2: act(x @ w1 + b1)),
        "mlp": (lambda x, w1, b1, w2: jax_hopper.mlp(x, w1, b1, w2, None, activation=activation, residual=x),
                lambda x, w1, b1, w2: act(x @ w1 + b1) @ w2 + x),
    }
    for name, (ours, theirs) in layers.items():
        def loss(fn):
            return lambda *p: 0.5 * jnp.sum(fn(*p).astype(jnp.float32) ** 2)

        exported = [_exported(fn, policy, *specs) for fn in (ours, theirs)]
        exported_grads = [_exported(jax.grad(loss(fn), argnums=(0, 1, 2, 3)), policy, *specs) for fn in (ours, theirs)]
        for seed, size in enumerate(SIZES):
            operands = _layer_operands((size,), d, f, dtype, seed)
            mine, jnps = (e.call(*operands) for e in exported)
            assert mine.shape == (size, f if name == "dense" else d) and mine.dtype == dtype, name
            np.testing.assert_array_equal(np.asarray(mine, np.float32), np.asarray(jnps, np.float32), err_msg=name)
            for g, h in zip(*(e.call(*operands) for e in exported_grads)):
                np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32), err_msg=name)


@pytest.mark.parametrize("policy", POLICIES)
def test_broadcast_bias_and_residual_with_a_symbolic_dim(policy):
    """dense's jnp broadcasting of a [1, F] bias and an [F] residual against a symbolic
    number of rows (the shapes are compared symbolically): jnp's layer, bit for bit."""
    b, = export.symbolic_shape("b")
    dtype, d, f = jnp.float16, 32, 64
    specs = (_spec((b, d), dtype), _spec((d, f), dtype), _spec((1, f), dtype), _spec((f,), dtype))
    ours = lambda x, w, bias, r: jax_hopper.dense(x, w, bias, activation="silu", residual=r)  # noqa: E731
    theirs = lambda x, w, bias, r: jax.nn.silu(x @ w + bias) + r  # noqa: E731
    exported = [_exported(fn, policy, *specs) for fn in (ours, theirs)]
    for seed, size in enumerate(SIZES):
        x, w, bias, _ = _layer_operands((size,), d, f, dtype, seed)
        operands = (x, w, bias[None], bias[::-1])
        mine, jnps = (e.call(*operands) for e in exported)
        assert mine.shape == (size, f)
        np.testing.assert_array_equal(np.asarray(mine, np.float32), np.asarray(jnps, np.float32))


@pytest.mark.parametrize("policy", POLICIES)
def test_vmap_over_a_symbolic_size(policy):
    """Inside vmap the shapes are numbers, so under "kernel" our primitives are bound; their
    batch rules then meet the symbolic size."""
    b, = export.symbolic_shape("b")
    dtype = jnp.float16
    x_spec, w_spec, bias_spec = _spec((b, 3, 32), dtype), _spec((32, 48), dtype), _spec((48,), dtype)
    product = _exported(jax.vmap(jax_hopper.matmul, in_axes=(0, None)), policy, x_spec, w_spec)
    layer = _exported(jax.vmap(lambda x, w, c: jax_hopper.dense(x, w, c, activation="gelu_tanh"),
                               in_axes=(0, None, None)), policy, x_spec, w_spec, bias_spec)
    jnps_layer = _exported(jax.vmap(lambda x, w, c: jax.nn.gelu(x @ w + c), in_axes=(0, None, None)), policy,
                           x_spec, w_spec, bias_spec)
    per_example_weights = _exported(jax.vmap(jax_hopper.matmul), policy, x_spec, _spec((b, 32, 48), dtype))
    for seed, size in enumerate(SIZES):
        x, w, c, _ = _layer_operands((size, 3), 32, 48, dtype, seed)
        out = product.call(x, w)
        assert_same_product(out.reshape(size * 3, 48), (x @ w).reshape(size * 3, 48), x.reshape(size * 3, 32), w, NN)
        ws = jnp.stack([w * (i + 1) for i in range(size)])
        assert_same_product(per_example_weights.call(x, ws), jnp.matmul(x, ws), x, ws, BATCHED)
        out = layer.call(x, w, c)
        assert out.shape == (size, 3, 48) and out.dtype == dtype
        if policy == "auto":  # these sizes are XLA's: the layer is jnp's (16-bit z, rounded twice)
            np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(jnps_layer.call(x, w, c), np.float32))
            continue
        # "kernel": the fused primitive's reference arithmetic, in f32 and rounded once.
        ref = jax.nn.gelu(jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest") +
                          c.astype(jnp.float32))
        err, err_round = relative_error(out, ref), relative_error(ref.astype(dtype), ref)
        assert err <= ERROR_FACTOR * err_round + 1e-6, f"{err:.3e} vs rounding alone {err_round:.3e}"

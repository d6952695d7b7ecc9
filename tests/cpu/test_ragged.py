"""CPU tests of the grouped products (ragged_dot): which forms reach the primitives, what
they lower to for CUDA, the dispatcher's rules, and the derivative rules' arithmetic
(on CPU the primitives compute through jax's ragged_dot_general, so the transposes'
forms are checked against the float64 reference here; the kernel itself in
tests/gpu/test_ragged_gpu.py)."""

from __future__ import annotations

import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cuda_text, use_mesh
from hypothesis import given, settings
from ragged_cases import (
    assert_gradients_within_rounding,
    assert_within_rounding,
    contract_reference,
    operands,
    rows_reference,
    sizes_of,
)

import jax_hopper
from jax_hopper.primitives.ragged_dot import ragged_contract, ragged_rows

TARGET = "jax_hopper_ragged_dot"
DTYPES = [pytest.param(jnp.float16, id="f16"), pytest.param(jnp.bfloat16, id="bf16")]
ROWS_T = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
CONTRACT = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])


def _calls(text):
    return re.findall(r"stablehlo\.custom_call @(\S+)\(", text)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", ["balanced", "skewed", "sparse", "short", "one"])
def test_equals_jax_ragged_dot(pattern, dtype):
    lhs, rhs = operands(300, 64, 48, 8, dtype, seed=1)
    sizes = sizes_of(pattern, 300, 8, seed=2)
    out = jax.jit(jax_hopper.ragged_dot)(lhs, rhs, sizes)
    expected = jax.lax.ragged_dot(lhs, rhs, sizes)
    assert out.dtype == expected.dtype and bool((out == expected).all())
    ref, mag = rows_reference(lhs, rhs, sizes)
    assert_within_rounding(out, ref, mag, 64)


def test_rows_past_the_sizes_are_zeros():
    lhs, rhs = operands(100, 16, 24, 3, jnp.float16)
    out = jax_hopper.ragged_dot(lhs, rhs, jnp.array([10, 0, 30], jnp.int32))
    assert bool((out[40:] == 0).all()) and bool((out[:40] != 0).any())


@pytest.mark.parametrize("shape", [(256, 128, 256, 8), (1000, 72, 264, 64), (17, 8, 16, 1)])
@pytest.mark.parametrize("dims", ["GKN", "GNK", "contract"])
def test_cuda_lowering_is_our_custom_call(shape, dims):
    m, k, n, groups = shape
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
    if dims == "contract":
        rhs = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
        fn, out = (lambda a, b, s: jax_hopper.ragged_dot_general(a, b, s, CONTRACT)), f"{groups}x{k}x{n}"
    else:
        rhs = jax.ShapeDtypeStruct((groups, n, k) if dims == "GNK" else (groups, k, n), jnp.bfloat16)
        fn = (lambda a, b, s: jax_hopper.ragged_dot_general(a, b, s, ROWS_T)) if dims == "GNK" else \
            jax_hopper.ragged_dot
        out = f"{m}x{n}"
    text = cuda_text(fn, lhs, rhs, sizes)
    assert _calls(text) == [TARGET], _calls(text)
    assert re.search(rf"-> \(tensor<{out}xbf16>, tensor<\d+xui8>\)", text), text
    assert "dot_general" not in text


def test_gradients_lower_to_our_calls():
    lhs = jax.ShapeDtypeStruct((512, 256), jnp.float16)
    rhs = jax.ShapeDtypeStruct((8, 256, 128), jnp.float16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)

    def loss(a, b, s):
        return jax_hopper.ragged_dot(a, b, s).astype(jnp.float32).sum()

    text = cuda_text(jax.grad(loss, argnums=(0, 1)), lhs, rhs, sizes)
    assert _calls(text) == [TARGET, TARGET], _calls(text)  # d lhs and d rhs (the forward is unused)


@pytest.mark.parametrize("reason", ["unaligned K", "too many groups", "f32 operands", "group offset"])
def test_other_forms_are_jax_s(reason):
    lhs, rhs, sizes = (jax.ShapeDtypeStruct((64, 64), jnp.float16), jax.ShapeDtypeStruct((4, 64, 64), jnp.float16),
                       jax.ShapeDtypeStruct((4,), jnp.int32))
    kwargs = {}
    if reason == "unaligned K":
        lhs, rhs = jax.ShapeDtypeStruct((64, 60), jnp.float16), jax.ShapeDtypeStruct((4, 60, 64), jnp.float16)
    elif reason == "too many groups":
        rhs, sizes = jax.ShapeDtypeStruct((1100, 64, 64), jnp.float16), jax.ShapeDtypeStruct((1100,), jnp.int32)
    elif reason == "f32 operands":
        lhs, rhs = (jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (lhs, rhs))
    if reason == "group offset":
        kwargs["group_offset"] = jax.ShapeDtypeStruct((1,), jnp.int32)
    path = jax_hopper.ragged_dot_path(lhs, rhs, sizes, **kwargs)
    assert path.path == "xla", path
    if reason == "group offset":  # jax's own answer, unchanged
        args = (jnp.zeros((8, 8), jnp.float16), jnp.zeros((2, 8, 8), jnp.float16), jnp.array([4, 4], jnp.int32))
        offset = jnp.array([1], jnp.int32)
        try:
            expected = jax.lax.ragged_dot(*args, group_offset=offset)
        except Exception as err:
            with pytest.raises(type(err)):
                jax_hopper.ragged_dot(*args, group_offset=offset)
        else:
            assert bool((jax_hopper.ragged_dot(*args, group_offset=offset) == expected).all())
    else:
        assert _calls(cuda_text(jax_hopper.ragged_dot, lhs, rhs, sizes)) == []


def test_dispatch_rules():
    lhs, rhs, sizes = (jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16),
                       jax.ShapeDtypeStruct((8, 2048, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((8,), jnp.int32))
    with jax_hopper.dispatch("kernel"):
        assert jax_hopper.ragged_dot_path(lhs, rhs, sizes).kind == "grouped"
        contract = jax_hopper.ragged_dot_path(lhs, jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16), sizes, CONTRACT)
        assert (contract.path, contract.kind) == ("kernel", "grouped_k")
    with jax_hopper.dispatch("xla"):
        assert jax_hopper.ragged_dot_path(lhs, rhs, sizes).path == "xla"
    with jax_hopper.dispatch("auto"):
        # The measured range (8 to 256 groups over >= 16384 rows, other dims >= 1024,
        # 16-bit results): ours; 1.11-3.17x the fastest JAX alternative there.
        big_lhs = jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16)
        big_rhs = jax.ShapeDtypeStruct((8, 4096, 14336), jnp.bfloat16)
        path = jax_hopper.ragged_dot_path(big_lhs, big_rhs, sizes)
        assert (path.path, path.rule, path.kind) == ("kernel", "ragged-groups", "grouped")
        contract = jax_hopper.ragged_dot_path(big_lhs, jax.ShapeDtypeStruct((16384, 14336), jnp.bfloat16), sizes,
                                              CONTRACT)
        assert (contract.path, contract.rule, contract.kind) == ("kernel", "ragged-groups", "grouped_k")
        # Outside it (fewer rows, fewer groups, f32 results): XLA's lowering.
        for args, kwargs in [((lhs, rhs, sizes), {}),
                             ((big_lhs, jax.ShapeDtypeStruct((4, 4096, 14336), jnp.bfloat16),
                               jax.ShapeDtypeStruct((4,), jnp.int32)), {}),
                             ((big_lhs, big_rhs, sizes), {"preferred_element_type": jnp.float32})]:
            path = jax_hopper.ragged_dot_path(*args, **kwargs)
            assert (path.path, path.rule) == ("xla", "ragged-not-measured"), (args, kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose", [False, True], ids=["GKN", "GNK"])
def test_gradients_match_the_reference(transpose, dtype):
    m, k, n, groups = 200, 32, 40, 5
    lhs, rhs = operands(m, k, n, groups, dtype, transpose=transpose, seed=3)
    sizes = sizes_of("short", m, groups, seed=4)
    ct = jax.random.normal(jax.random.key(5), (m, n), jnp.float32).astype(dtype)
    dims = ROWS_T if transpose else jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])
    _, vjp = jax.vjp(lambda a, b: jax_hopper.ragged_dot_general(a, b, sizes, dims), lhs, rhs)
    d_lhs, d_rhs = vjp(ct)
    assert_gradients_within_rounding(d_lhs, d_rhs, lhs, rhs, ct, sizes, transpose)
    assert d_lhs.dtype == dtype and d_rhs.dtype == dtype


def test_second_order_and_the_contraction_s_gradients():
    m, a, b, groups = 120, 16, 24, 4
    x, _ = operands(m, a, 8, 1, jnp.float32, seed=6)
    y, _ = operands(m, b, 8, 1, jnp.float32, seed=7)
    x, y = x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)
    sizes = sizes_of("balanced", m, groups)
    ct = jax.random.normal(jax.random.key(8), (groups, a, b), jnp.float32).astype(jnp.bfloat16)
    _, vjp = jax.vjp(lambda p, q: ragged_contract(p, q, sizes), x, y)
    d_x, d_y = vjp(ct)
    ref, mag = rows_reference(y, jnp.swapaxes(ct, 1, 2), sizes)  # d x[r] = ct[g] y[r]
    assert_within_rounding(d_x, ref, mag, b)
    ref, mag = rows_reference(x, ct, sizes)  # d y[r] = x[r] ct[g]
    assert_within_rounding(d_y, ref, mag, a)
    # jvp of the forward: bilinear.
    lhs, rhs = operands(64, 16, 16, 2, jnp.float16, seed=9)
    s2 = jnp.array([30, 34], jnp.int32)
    _, tangent = jax.jvp(lambda p, q: ragged_rows(p, q, s2), (lhs, rhs), (lhs, jnp.zeros_like(rhs)))
    assert bool((tangent == ragged_rows(lhs, rhs, s2)).all())


@pytest.mark.parametrize("sizes", [[20, 20, 24], [10, 0, 30], [50, 40, 30]], ids=["full", "short", "over"])
def test_vmap_over_lhs_is_one_product(sizes):
    """jax's own ragged_dot has no vmap rule for a batched lhs alone; ours folds the
    entries into one launch (a gap group after each entry's groups)."""
    lhs, rhs = operands(64, 16, 24, 3, jnp.float16, seed=10)
    lhs_b = jnp.stack([lhs, -lhs, 2 * lhs])
    sizes = jnp.array(sizes, jnp.int32)
    f = jax.vmap(lambda x: jax_hopper.ragged_dot(x, rhs, sizes))
    out = f(lhs_b)
    expected = jnp.stack([jax.lax.ragged_dot(x, rhs, sizes) for x in lhs_b])
    assert bool((out == expected).all())
    text = cuda_text(f, lhs_b)
    assert _calls(text) == [TARGET]
    # Its gradients: d lhs per entry, d rhs summed over the entries.
    ct = jax.random.normal(jax.random.key(11), out.shape, jnp.float32).astype(jnp.float16)
    _, vjp = jax.vjp(lambda x, w: jax.vmap(lambda xi: jax_hopper.ragged_dot(xi, w, sizes))(x), lhs_b, rhs)
    d_lhs, d_rhs = vjp(ct)
    for b in range(3):
        ref, mag = rows_reference(ct[b], jnp.swapaxes(rhs, 1, 2), sizes)
        assert_within_rounding(d_lhs[b], ref, mag, 24)
    refs = [contract_reference(lhs_b[b], ct[b], sizes) for b in range(3)]
    ref, mag = sum(r for r, _ in refs), sum(m for _, m in refs)
    assert_within_rounding(d_rhs, ref, mag, 3 * 64)


def test_bad_shapes_raise_jax_s_errors():
    with pytest.raises((TypeError, ValueError)):
        jax_hopper.ragged_dot(jnp.zeros((8, 8), jnp.float16), jnp.zeros((2, 6, 8), jnp.float16),
                              jnp.array([4, 4], jnp.int32))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 80), k=st.sampled_from([8, 16, 24]), n=st.sampled_from([8, 16, 40]),
       groups=st.integers(1, 9), seed=st.integers(0, 2**16), f32_out=st.booleans())
def test_property_equals_jax(m, k, n, groups, seed, f32_out):
    rng = np.random.default_rng(seed)
    sizes = jnp.asarray(rng.multinomial(int(rng.integers(0, m + 1)), np.ones(groups) / groups), jnp.int32)
    lhs, rhs = operands(m, k, n, groups, jnp.bfloat16, seed=seed)
    out_type = jnp.float32 if f32_out else None
    out = jax_hopper.ragged_dot(lhs, rhs, sizes, preferred_element_type=out_type)
    expected = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=out_type)
    assert out.dtype == expected.dtype and bool((out == expected).all())


def test_moe_layer_on_either_grouped_product():
    """The flax MoE layer on jax_hopper.ragged_dot and on jax.lax.ragged_dot, same
    parameters: the same values and gradients (on CPU both are jax's arithmetic)."""
    from jax_hopper.nn import MoE

    x = jax.random.normal(jax.random.key(0), (4, 32, 64), jnp.bfloat16)
    ours = MoE(num_experts=8, hidden_features=96, top_k=2)
    theirs = MoE(num_experts=8, hidden_features=96, top_k=2, ragged_dot=jax.lax.ragged_dot)
    params = ours.init(jax.random.key(1), x)
    out = jax.jit(ours.apply)(params, x)
    assert out.shape == x.shape and out.dtype == jnp.bfloat16
    assert bool((out == jax.jit(theirs.apply)(params, x)).all())

    def loss(module):
        return lambda p: jnp.square(module.apply(p, x).astype(jnp.float32)).mean()

    g_ours, g_theirs = jax.grad(loss(ours))(params), jax.grad(loss(theirs))(params)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_theirs)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=1e-4)
    with jax_hopper.dispatch("kernel"):
        text = cuda_text(lambda p: jax.grad(loss(ours))(p), params)
    # 3 forward products; d down, d h, d gate, d up (no gradient reaches the routed rows: x is data)
    assert _calls(text).count(TARGET) == 7


def _cpu_mesh(axis, axis_type):
    """A mesh of 8 CPU devices along one axis (tests/conftest.py asks jax for them)."""
    from jax.sharding import AxisType

    cpus = jax.devices("cpu")
    if len(cpus) < 8:
        pytest.skip("needs 8 CPU devices (jax_num_cpu_devices)")
    return jax.make_mesh((8,), (axis,), axis_types=(getattr(AxisType, axis_type),), devices=cpus[:8])


@pytest.mark.parametrize("policy", ["kernel", "auto"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_rows_sharded_under_jit(axis_type, policy):
    """Tokens sharded over 8 CPU devices (32 rows each; groups straddle the shards).
    Auto axes: custom_partitioning splits each of our products by rows, every device with
    the group sizes clipped to its rows (under "auto" these small products are XLA's).
    Explicit axes (where jax's own ragged_dot has no sharding rule): the same in a
    shard_map. The weight gradient is summed over the shards. Values and gradients are
    the unsharded ones, the rows stay sharded."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _cpu_mesh("x", axis_type)
    lhs, rhs = operands(256, 32, 48, 4, jnp.bfloat16, seed=20)
    sizes = sizes_of("short", 256, 4, seed=21)
    ct = jax.random.normal(jax.random.key(22), (256, 48), jnp.float32).astype(jnp.bfloat16)

    def value_and_grads(x, w, s, c):
        with jax_hopper.dispatch(policy):
            out, vjp = jax.vjp(lambda a, b: jax_hopper.ragged_dot(a, b, s), x, w)
            return out, vjp(c)

    expected = jax.jit(value_and_grads)(lhs, rhs, sizes, ct)
    with use_mesh(mesh):
        rows = NamedSharding(mesh, PartitionSpec("x", None))
        got = jax.jit(value_and_grads)(jax.device_put(lhs, rows), rhs, sizes, jax.device_put(ct, rows))
        if axis_type == "Auto" and policy == "kernel":  # all three products partitioned, none gathered
            text = cuda_text(value_and_grads, jax.device_put(lhs, rows), rhs, sizes, jax.device_put(ct, rows))
            assert text.count("@CustomSPMDPartitioning") == 3, text
    out, (d_lhs, d_rhs) = got
    assert out.sharding.spec[0] == "x" and d_lhs.sharding.spec[0] == "x"
    assert bool((out == expected[0]).all()) and bool((d_lhs == expected[1][0]).all())
    # d rhs: per-shard f32 sums added in another order than the unsharded sum.
    ref, mag = contract_reference(lhs, ct, sizes)
    assert_within_rounding(d_rhs, ref, mag, 256)


@pytest.mark.parametrize("transpose", [False, True], ids=["GKN", "GNK"])
def test_each_device_multiplies_its_rows_on_the_kernel(transpose):
    """The partition callback's per-device body on Auto axes: lowered for CUDA on a
    device's 32-row shard, it is the grouped kernel's call with the sizes clipped to the
    shard's rows (computed from its slice of the row indices)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jax_hopper.primitives import ragged_dot as rd

    mesh = _cpu_mesh("x", "Auto")
    bf16 = jnp.dtype(jnp.bfloat16)
    w_shape = (4, 48, 32) if transpose else (4, 32, 48)
    arg_shapes = (jax.ShapeDtypeStruct((256, 32), bf16, sharding=NamedSharding(mesh, PartitionSpec("x", None))),
                  jax.ShapeDtypeStruct(w_shape, bf16, sharding=NamedSharding(mesh, PartitionSpec())),
                  jax.ShapeDtypeStruct((4,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec())),
                  jax.ShapeDtypeStruct((256,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec("x"))))
    args, out = rd._rows_plan(mesh, arg_shapes, transpose)
    assert out.spec == PartitionSpec("x", None) and args[3].spec == PartitionSpec("x")
    shards = (jax.ShapeDtypeStruct((32, 32), bf16), jax.ShapeDtypeStruct(w_shape, bf16),
              jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((32,), jnp.int32))

    def body(x, w, s, rows):
        return rd._rows_cuda(x, w, rd._local_sizes(s, rows), transpose_rhs=transpose, out_dtype=bf16)

    assert _calls(cuda_text(body, *shards)) == [TARGET]
    # The clipping itself: a shard from row 64 of groups [50, 0, 100, 70] holds 36 rows of
    # group 2 (rows 50-149), none of 0, 1 or 3 past its 32 rows.
    local = rd.shard_sizes(jnp.array([50, 0, 100, 70]), 64, 32)
    assert local.tolist() == [0, 0, 32, 0]
    local = rd.shard_sizes(jnp.array([50, 0, 100, 70]), 128, 32)
    assert local.tolist() == [0, 0, 22, 10]
    local = rd.shard_sizes(jnp.array([50, 0, 100, 70]), 224, 32)
    assert local.tolist() == [0, 0, 0, 0]  # rows past the sizes' sum: zeros
    # Sizes past int32 in sum (and negative ones) saturate at the rows, as the kernel's do.
    huge = jnp.array([-5, 2**31 - 1, 2**31 - 1, 7], jnp.int32)
    assert rd.shard_sizes(huge, 224, 32).tolist() == [0, 32, 0, 0]


def _contraction_operands(dtype, seed):
    """x [256, 24] and y [256, 40] (the rows the groups split) and 6 skewed group sizes."""
    x, _ = operands(256, 24, 8, 1, dtype, seed=seed)
    y, _ = operands(256, 40, 8, 1, dtype, seed=seed + 1)
    return x, y, sizes_of("skewed", 256, 6, seed=seed + 2)


def _rows_sharded(mesh, *arrays):
    from jax.sharding import NamedSharding, PartitionSpec

    rows = NamedSharding(mesh, PartitionSpec("x", None))
    return tuple(jax.device_put(a, rows) for a in arrays)


def test_contraction_rows_sharded_on_auto_axes():
    """The weight gradient's form with its rows sharded on Auto axes: each device's f32
    sums per group over its rows, added across the devices, rounded once."""
    mesh = _cpu_mesh("x", "Auto")
    x, y, sizes = _contraction_operands(jnp.bfloat16, seed=26)
    with use_mesh(mesh):
        xs, ys = _rows_sharded(mesh, x, y)
        with jax_hopper.dispatch("kernel"):
            f = jax.jit(lambda a, b, s: jax_hopper.ragged_dot_general(a, b, s, CONTRACT))
            out = f(xs, ys, sizes)
            assert f.trace(xs, ys, sizes).lower(lowering_platforms=("cuda",)).as_text().count(
                "@CustomSPMDPartitioning") == 1
    ref, mag = contract_reference(x, y, sizes)
    assert_within_rounding(out, ref, mag, 256)


def test_contraction_rows_sharded_explicitly():
    mesh = _cpu_mesh("x", "Explicit")
    x, y, sizes = _contraction_operands(jnp.float16, seed=23)
    with use_mesh(mesh):
        f = jax.jit(lambda a, b, s: jax_hopper.ragged_dot_general(a, b, s, CONTRACT))
        xs, ys = _rows_sharded(mesh, x, y)
        out = f(xs, ys, sizes)
        with jax_hopper.dispatch("kernel"):  # each shard's sum on the kernel, for CUDA
            assert _calls(f.trace(xs, ys, sizes).lower(lowering_platforms=("cuda",)).as_text()) == [TARGET]
    ref, mag = contract_reference(x, y, sizes)
    assert_within_rounding(out, ref, mag, 256)


@pytest.mark.parametrize("capacity", [None, 6])
def test_expert_parallel_recipe(capacity):
    """Experts sharded over 8 CPU devices in a shard_map (ragged_dot_expert_parallel):
    each device's rows against every expert, wherever it lives, as one unsharded
    ragged_dot per device would compute them; past the capacity, zeros; gradients too."""
    from jax.sharding import PartitionSpec as P

    mesh = _cpu_mesh("e", "Auto")
    devices, rows, k, n, experts = 8, 24, 16, 32, 16
    lhs, rhs = operands(devices * rows, k, n, experts, jnp.float16, seed=30)
    rng = np.random.default_rng(31)
    sizes = jnp.asarray(np.stack([rng.multinomial(rows - d, np.ones(experts) / experts) for d in range(devices)]),
                        jnp.int32)  # device d routes rows - d of its rows; the rest are padding

    def ep(x, w, s):
        return jax_hopper.ragged.ragged_dot_expert_parallel(x, w, s[0], "e", capacity=capacity)

    f = jax.jit(jax.shard_map(ep, mesh=mesh, in_specs=(P("e", None), P("e", None, None), P("e", None)),
                              out_specs=P("e", None)))
    out = f(lhs, rhs, sizes)
    with jax_hopper.dispatch("kernel"):  # each device's grouped product on the kernel, for CUDA
        assert _calls(f.trace(lhs, rhs, sizes).lower(lowering_platforms=("cuda",)).as_text()) == [TARGET]
    for d in range(devices):
        x, s = lhs[d * rows:(d + 1) * rows], sizes[d]
        expected = jax.lax.ragged_dot(x, rhs, s)
        if capacity is not None:  # rows past the capacity of each destination device are dropped
            per_dest = np.asarray(s).reshape(devices, -1).sum(1)
            start = np.cumsum(per_dest) - per_dest
            keep = np.zeros(rows, bool)
            for j in range(devices):
                keep[start[j]:start[j] + min(per_dest[j], capacity)] = True
            expected = jnp.where(keep[:, None], expected, 0)
        assert bool((out[d * rows:(d + 1) * rows] == expected).all()), d
    if capacity is None:
        ct = jax.random.normal(jax.random.key(32), out.shape, jnp.float32).astype(jnp.float16)
        _, vjp = jax.vjp(f, lhs, rhs, sizes)
        d_lhs, d_rhs, _ = vjp(ct)
        for d in range(devices):
            s = sizes[d]
            ref, mag = rows_reference(ct[d * rows:(d + 1) * rows], jnp.swapaxes(rhs, 1, 2), s)
            assert_within_rounding(d_lhs[d * rows:(d + 1) * rows], ref, mag, n)
        refs = [contract_reference(lhs[d * rows:(d + 1) * rows], ct[d * rows:(d + 1) * rows], sizes[d])
                for d in range(devices)]
        assert_within_rounding(d_rhs, sum(r for r, _ in refs), sum(m for _, m in refs), devices * rows)


def test_f32_result_gradients_match_jax():
    """preferred_element_type=f32: the cotangent is f32, so the gradients take jax's
    arithmetic (the kernel multiplies 16-bit operands); they match jax's own."""
    lhs, rhs = operands(120, 16, 24, 4, jnp.bfloat16, seed=40)
    sizes = sizes_of("skewed", 120, 4, seed=41)

    def loss(fn):
        return lambda a, b: jnp.square(fn(a, b, sizes, preferred_element_type=jnp.float32)).sum()

    ours = jax.grad(loss(jax_hopper.ragged_dot), argnums=(0, 1))(lhs, rhs)
    theirs = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        # one bf16 ulp apart at most: both round an f32 sum once, summed in another order
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2.0**-7, atol=2.0**-14)

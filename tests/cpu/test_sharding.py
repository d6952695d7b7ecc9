"""Sharded products under jax.jit and shard_map: partitioned as jnp.dot is.

Runs on real GPUs where at least two are visible (our kernel on each shard), otherwise
on eight CPU devices (conftest), where the same partitioning rules wrap the fallback.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_product, cuda_text, full_f32, kernel_ids, relative_error, use_mesh
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_hopper

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
DEVICES = GPUS if len(GPUS) >= 2 else jax.devices("cpu")
if len(DEVICES) >= 8:
    MESH_SHAPE = (4, 2)
elif len(DEVICES) >= 2:
    MESH_SHAPE = (len(DEVICES) // 2 * 2 // 2, 2) if len(DEVICES) >= 4 else (len(DEVICES), 1)
else:
    MESH_SHAPE = None
pytestmark = pytest.mark.skipif(MESH_SHAPE is None, reason="needs >= 2 devices (GPUs, or CPU devices via conftest)")
ON_GPU = DEVICES is GPUS
M, N, K, B = 128, 96, 64, 4  # divisible by every mesh axis size used


def mesh(axis_type=AxisType.Auto):
    n = MESH_SHAPE[0] * MESH_SHAPE[1]
    return jax.make_mesh(MESH_SHAPE, ("x", "y"), axis_types=(axis_type, axis_type), devices=DEVICES[:n])


def _random(key, shape, dtype=jnp.float16):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


DN = (((1,), (0,)), ((), ()))
PATTERNS = {  # name: (a shape, b shape, dimension numbers, a spec, b spec)
    "data_parallel_M": ((M, K), (K, N), DN, P("x", None), P()),
    "column_parallel_N": ((M, K), (K, N), DN, P(), P(None, "x")),
    "row_parallel_K": ((M, K), (K, N), DN, P(None, "x"), P("x", None)),
    "K_sharded_on_one_operand": ((M, K), (K, N), DN, P(None, "x"), P()),
    "M_and_N_2d": ((M, K), (K, N), DN, P("x", None), P(None, "y")),
    "M_and_K_mixed": ((M, K), (K, N), DN, P("x", "y"), P("y", None)),
    "batch": ((B, M, K), (B, K, N), (((2,), (1,)), ((0,), (0,))), P("x", None, None), P("x", None, None)),
    "NT_N_sharded": ((M, K), (N, K), (((1,), (1,)), ((), ())), P(), P("x", None)),
    "TN_K_sharded": ((K, M), (K, N), (((0,), (0,)), ((), ())), P("x", None), P("x", None)),
    # x [B, S, K] @ W with the sequence dim sharded (x's leading dims used to be folded
    # into M before the primitive: XLA all-gathered x and every device computed it all).
    "sequence_sharded_x_at_W": ((B, M, K), (K, N), (((2,), (0,)), ((), ())), P(None, "x", None), P()),
    "sequence_and_column": ((B, M, K), (K, N), (((2,), (0,)), ((), ())), P(None, "x", None), P(None, "y")),
    "sequence_and_K": ((B, M, K), (K, N), (((2,), (0,)), ((), ())), P(None, "x", "y"), P("y", None)),
    # Attention scores q k^T over [batch, heads, S, D] with the heads sharded (tensor
    # parallel): the batch dims used to be folded into one before the primitive, and XLA
    # all-gathered q and k and replicated the scores.
    "heads_sharded_attention": ((2, B, M, K), (2, B, N, K), (((3,), (3,)), ((0, 1), (0, 1))), P(None, "x"),
                                P(None, "x")),
    "two_batch_dims_sharded": ((2, B, M, K), (2, B, K, N), (((3,), (2,)), ((0, 1), (0, 1))), P("y", "x"),
                               P("y", "x")),
    "heads_sharded_batch_dims_inside": ((B, M, 2, K), (B, K, 2, N), (((3,), (1,)), ((0, 2), (0, 2))),
                                        P("x"), P("x")),
    # One axis on M and on a wider N: the partitioner shards the result on N, as jnp's
    # (the smaller x gathered); our plan kept M, gathered w and all-to-all'd the result.
    "one_axis_on_M_and_wider_N": ((M, K), (K, 4 * M), DN, P("x", None), P(None, "x")),
    "one_axis_on_wider_M_and_N": ((4 * N, K), (K, N), DN, P("x", None), P(None, "x")),
}


def _collectives(text):
    return {op: len(re.findall(rf"\b{op}(-start)?\(", text)) for op in ("all-gather", "all-reduce", "all-to-all")}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_partitioned_like_jnp_dot(pattern):
    a_shape, b_shape, dims, sa, sb = PATTERNS[pattern]
    mm = mesh()
    ka, kb = jax.random.split(jax.random.key(len(pattern)))
    a = jax.device_put(_random(ka, a_shape), NamedSharding(mm, sa))
    b = jax.device_put(_random(kb, b_shape), NamedSharding(mm, sb))
    ours_fn = jax.jit(lambda x, y: jax_hopper.dot_general(x, y, dims))
    ref_fn = jax.jit(lambda x, y: lax.dot_general(x, y, dims))
    ours, ref = ours_fn(a, b), ref_fn(a, b)
    assert_same_product(ours, ref, a, b, dims)
    assert ours.sharding.is_equivalent_to(ref.sharding, ours.ndim), (ours.sharding, ref.sharding)
    text, ref_text = ours_fn.lower(a, b).compile().as_text(), ref_fn.lower(a, b).compile().as_text()
    got, want = _collectives(text), _collectives(ref_text)
    assert got["all-gather"] <= want["all-gather"], (got, want)  # never gathers a full operand jnp.dot keeps sharded
    assert got["all-reduce"] == want["all-reduce"] and got["all-to-all"] == want["all-to-all"], (got, want)
    if ON_GPU:
        assert 'custom_call_target="jax_hopper_gemm"' in text and "__cublas" not in text


@pytest.mark.parametrize("pattern", ["data_parallel_M", "column_parallel_N", "row_parallel_K",
                                     "sequence_sharded_x_at_W"])
def test_the_xla_kind_is_jnp_dots_program(pattern):
    """The primitive with kernel "xla" (an f32 result of f16 operands left to XLA, bound
    only for its derivative rule) compiles to XLA's own dot, partitioned by XLA itself:
    no custom call (neither ours nor custom_partitioning's), the same collectives and
    values as jnp's dot."""
    from jax_hopper.primitives.gemm import XLA_KERNEL, gemm

    a_shape, b_shape, dims, sa, sb = PATTERNS[pattern]
    mm = mesh()
    ka, kb = jax.random.split(jax.random.key(len(pattern)))
    a = jax.device_put(_random(ka, a_shape), NamedSharding(mm, sa))
    b = jax.device_put(_random(kb, b_shape), NamedSharding(mm, sb))
    ours_fn = jax.jit(lambda x, y: gemm(x, y, out_dtype=jnp.float32, kernel=XLA_KERNEL))
    ref_fn = jax.jit(lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=jnp.float32))
    ours, ref = ours_fn(a, b), ref_fn(a, b)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
    text, ref_text = ours_fn.lower(a, b).compile().as_text(), ref_fn.lower(a, b).compile().as_text()
    assert "SPMDPartitioning" not in ours_fn.lower(a, b).as_text()  # not custom_partitioning's
    assert "jax_hopper_gemm" not in text
    assert text.count("custom-call(") == ref_text.count("custom-call(")  # cuBLAS's (or oneDNN's) as jnp's
    assert _collectives(text) == _collectives(ref_text)


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_dense_with_sequence_sharded_activations_is_not_gathered(activation):
    """The fused dense keeps x's leading dims too: x [B, S@x, K] against replicated
    weights needs no collective (jnp's block needs none), and its result keeps S sharded."""
    mm = mesh()
    x = jax.device_put(_random(jax.random.key(30), (B, M, K)), NamedSharding(mm, P(None, "x", None)))
    w = jax.device_put(_random(jax.random.key(31), (K, N)), NamedSharding(mm, P()))
    bias = jax.device_put(_random(jax.random.key(32), (N,)), NamedSharding(mm, P()))
    r = jax.device_put(_random(jax.random.key(33), (B, M, N)), NamedSharding(mm, P(None, "x", None)))
    with jax_hopper.dispatch("kernel"):
        f = jax.jit(lambda x, w, b, r: jax_hopper.dense(x, w, b, activation=activation, residual=r))
        ours = f(x, w, bias, r)
        text = f.lower(x, w, bias, r).compile().as_text()
    act = {None: lambda z: z, "gelu_tanh": jax.nn.gelu}[activation]
    ref = jax.jit(lambda x, w, b, r: act(x @ w + b) + r)(x, w, bias, r)
    assert relative_error(ours, ref.astype(jnp.float32)) < 1e-2
    assert _collectives(text) == {"all-gather": 0, "all-reduce": 0, "all-to-all": 0}, _collectives(text)
    assert ours.sharding.is_equivalent_to(NamedSharding(mm, P(None, "x", None)), 3), ours.sharding


def test_each_device_multiplies_only_its_shard():
    mm = mesh()
    a = jax.device_put(_random(jax.random.key(0), (M, K)), NamedSharding(mm, P("x", None)))
    b = jax.device_put(_random(jax.random.key(1), (K, N)), NamedSharding(mm, P(None, "y")))
    text = jax.jit(jax_hopper.matmul).lower(a, b).compile().as_text()
    local = f"f16[{M // MESH_SHAPE[0]},{N // MESH_SHAPE[1]}]"
    assert f"f16[{M},{N}]" not in text  # no device materialises the whole product
    if ON_GPU:
        assert any(local in line and 'custom_call_target="jax_hopper_gemm"' in line for line in text.splitlines())
    else:  # the CPU fallback's dot is fused with converts; its result is the local block
        assert local in text


# An odd-K product (only A's rows padded) that the rules send to our small-M kind whole
# (2048 rows, 256 of its 64x128 tiles; _dispatch.kernel_for), measured 1.97x jnp.dot. Its
# 512-row shards would be the default kernel's 16 tiles (a loss: the rules leave that to
# XLA), and 2048-row shards of a 4x longer product, which runs the default kernel whole,
# run the small-M kind.
SHARD_ROWS_TO_XLA, SHARD_ROWS_TO_SMALL_M, SHARD_N, SHARD_K = 512, 2048, 1024, 4095
SHARD_MESH_SIZE = 4


def _custom_call_kinds(text):
    """The `kernel` attribute of every jax_hopper_gemm call in a StableHLO module."""
    return [int(k) for k in re.findall(r"custom_call @jax_hopper_gemm\(.*?kernel = (\d+)", text)]


def _shard_mesh(axis_type):
    """SHARD_MESH_SIZE CPU devices on one axis "x" (the lowering tests below lower for CUDA
    from them); skips where those, or our built kernel, are missing."""
    if not jax_hopper.kernel_available():
        pytest.skip("without the built kernel every product lowers to XLA's dot")
    cpus = jax.devices("cpu")
    if len(cpus) < SHARD_MESH_SIZE:
        pytest.skip(f"needs {SHARD_MESH_SIZE} CPU devices (conftest sets jax_num_cpu_devices)")
    return jax.make_mesh((SHARD_MESH_SIZE,), ("x",), axis_types=(axis_type,), devices=cpus[:SHARD_MESH_SIZE])


@pytest.mark.parametrize("rows, sharded, want", [
    (SHARD_ROWS_TO_XLA * SHARD_MESH_SIZE, False, "small_m"),
    (SHARD_ROWS_TO_XLA * SHARD_MESH_SIZE, True, "xla"),
    (SHARD_ROWS_TO_SMALL_M * SHARD_MESH_SIZE, False, "persistent"),
    (SHARD_ROWS_TO_SMALL_M * SHARD_MESH_SIZE, True, "small_m"),
])
def test_each_device_asks_the_rules_for_its_shards(rows, sharded, want):
    """Under policy "auto" the kind is picked for the product's shape when it is traced,
    and each device multiplies only its shards: the rules are asked again for those (a
    shard outside what they measured goes to XLA's dot, or to the kind they pick there).
    Explicit mesh axes plan the shards while lowering, so the lowered module shows each
    device's pick (no device needed; lowered for CUDA from four CPU devices)."""
    KERNELS = kernel_ids()

    mm = _shard_mesh(AxisType.Explicit)
    a = jax.ShapeDtypeStruct((rows, SHARD_K), jnp.float16, sharding=NamedSharding(mm, P("x" if sharded else None)))
    b = jax.ShapeDtypeStruct((SHARD_K, SHARD_N), jnp.float16, sharding=NamedSharding(mm, P()))
    with use_mesh(mm):
        with jax_hopper.dispatch("auto"):
            assert jax_hopper.dispatch_path(a, b, DN)[0] == "kernel"  # the whole product is ours
            text = cuda_text(jax_hopper.matmul, a, b)
    assert "sdy.manual_computation" in text  # each device's product in a shard_map
    if want == "xla":
        assert _custom_call_kinds(text) == [] and len(re.findall(r"stablehlo\.dot_general", text)) == 1
    else:
        assert _custom_call_kinds(text) == [KERNELS[want]] and "stablehlo.dot_general" not in text


@pytest.mark.parametrize("sharded", [False, True])
def test_a_kind_asked_for_by_name_runs_on_every_shard(sharded):
    """Only the rules' own picks are picked again: the small-M kind asked for by name on
    an aligned 1024x4096x4096 (kernel_for would give it, and its 256-row shards, the
    default kernel) lowers to the small-M kind, whole and on each device."""
    from jax_hopper._kernels import SMALL_M_KIND as SMALL_M_KERNEL
    from jax_hopper.primitives.gemm import gemm
    KERNELS = kernel_ids()

    mm = _shard_mesh(AxisType.Explicit)
    a = jax.ShapeDtypeStruct((1024, 4096), jnp.float16, sharding=NamedSharding(mm, P("x" if sharded else None)))
    b = jax.ShapeDtypeStruct((4096, 4096), jnp.float16, sharding=NamedSharding(mm, P()))
    with use_mesh(mm):
        text = cuda_text(lambda x, y: gemm(x, y, kernel=SMALL_M_KERNEL), a, b)
    assert _custom_call_kinds(text) == [KERNELS[SMALL_M_KERNEL]]


@pytest.mark.parametrize("size, want", [(16384, "xla"), (8191, "persistent")])
def test_a_sharded_contraction_asks_the_rules_for_f32_partial_sums(size, want):
    """With K split, each device multiplies into f32 partial sums, and the rules are asked
    about that product: a 16384^3 that "wide-aligned" takes whole (16-bit output, the only
    one it measured) runs XLA's dot on its K shards; an unaligned 8191 x 8191 x 8192 keeps
    the default kernel (unaligned rows, f32 output or not)."""
    from jax_hopper._kernels import DEFAULT_KIND as DEFAULT_KERNEL
    from jax_hopper.primitives.gemm import gemm
    KERNELS = kernel_ids()

    mm = _shard_mesh(AxisType.Explicit)
    k = size + size % 2  # even, so that it splits over the mesh
    a = jax.ShapeDtypeStruct((size, k), jnp.float16, sharding=NamedSharding(mm, P(None, "x")))
    b = jax.ShapeDtypeStruct((k, size), jnp.float16, sharding=NamedSharding(mm, P("x", None)))
    whole = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (a, b)]  # (jax asks an out_sharding of a K split)
    with jax_hopper.dispatch("auto"):
        assert jax_hopper.dispatch_path(*whole, DN) == ("kernel", "wide-aligned" if want == "xla" else "unaligned-rows")
    with use_mesh(mm):
        text = cuda_text(lambda x, y: gemm(x, y, kernel=DEFAULT_KERNEL, rules=True), a, b)
    assert "sdy.manual_computation" in text and "stablehlo.all_reduce" in text  # f32 partial sums, summed
    if want == "xla":
        assert _custom_call_kinds(text) == [] and re.search(r"stablehlo\.dot_general.*-> tensor<\d+x\d+xf32>", text)
    else:
        assert _custom_call_kinds(text) == [KERNELS[want]] and "stablehlo.dot_general" not in text


@pytest.mark.parametrize("rules, want", [(False, "small_m"), (True, "xla")])
def test_auto_axes_partitioned_products_pick_their_kind_per_device(rules, want):
    """On Auto mesh axes XLA's partitioner calls _partition while compiling; the body it
    returns is each device's product on its shards: lowered for CUDA, an odd-K
    2048x1024x4095 split over 4 devices by M runs XLA's dot on its 512-row shards where
    the rules picked the small-M kind, and the small-M kind where it was asked for."""
    from jax_hopper._kernels import SMALL_M_KIND as SMALL_M_KERNEL
    from jax_hopper._kernels import stages_of
    from jax_hopper.primitives.gemm import _cuda_impl
    KERNELS = kernel_ids()
    from jax_hopper.primitives.gemm import _partition

    mm = _shard_mesh(AxisType.Auto)
    rows = SHARD_ROWS_TO_XLA * SHARD_MESH_SIZE
    f16 = jnp.dtype(jnp.float16)
    arg_shapes = (jax.ShapeDtypeStruct((rows, SHARD_K), f16, sharding=NamedSharding(mm, P("x", None))),
                  jax.ShapeDtypeStruct((SHARD_K, SHARD_N), f16, sharding=NamedSharding(mm, P())))
    result = jax.ShapeDtypeStruct((rows, SHARD_N), f16, sharding=NamedSharding(mm, P("x", None)))
    _, per_device, out_sharding, _ = _partition(_cuda_impl, False, False, f16, SMALL_M_KERNEL,
                                                stages_of(SMALL_M_KERNEL), rules, mm, arg_shapes, result)
    assert out_sharding.spec == P("x", None)
    shards = (jax.ShapeDtypeStruct((SHARD_ROWS_TO_XLA, SHARD_K), f16), jax.ShapeDtypeStruct((SHARD_K, SHARD_N), f16))
    text = cuda_text(per_device, *shards)
    if want == "xla":
        assert _custom_call_kinds(text) == [] and "stablehlo.dot_general" in text
    else:
        assert _custom_call_kinds(text) == [KERNELS[want]]


# A fused dense layer the rules put on the fused kind ("fused-activation": every dimension
# >= 4096). M-sharded over 4 devices, its 2048-row shards are still the fused kind's with
# exact GELU (one of M, K down to 2048 with N >= 8192 was measured ahead) but not with
# tanh-GELU (measured ahead only with every dimension >= 4096).
LAYER_ROWS, LAYER_K, LAYER_N = 8192, 4096, 8192


def _fused_calls(text):
    return len(re.findall(r"custom_call @jax_hopper_gemm_fused\(", text))


def _layer_operands(mm, x_spec, w_spec=P()):
    f16 = jnp.float16
    return (jax.ShapeDtypeStruct((LAYER_ROWS, LAYER_K), f16, sharding=NamedSharding(mm, x_spec)),
            jax.ShapeDtypeStruct((LAYER_K, LAYER_N), f16, sharding=NamedSharding(mm, w_spec)),
            jax.ShapeDtypeStruct((LAYER_N,), f16, sharding=NamedSharding(mm, P())))


@pytest.mark.parametrize("activation, policy, sharded, fused", [
    ("gelu_tanh", "auto", False, True),
    ("gelu_tanh", "auto", True, False),
    ("gelu_exact", "auto", True, True),
    ("gelu_tanh", "kernel", True, True),
])
def test_each_device_asks_the_rules_for_its_fused_layer(activation, policy, sharded, fused):
    """As for plain products: where the rules picked the fused kind for the whole layer,
    each device's shards are asked about again, and a shard outside what they measured
    is jnp's layer (XLA's dot with a 16-bit result, then bias and activation), as the
    same shapes unsharded are. Policy "kernel" keeps the fused kind on every shard."""
    mm = _shard_mesh(AxisType.Explicit)
    x, w, b = _layer_operands(mm, P("x" if sharded else None))
    with use_mesh(mm):
        with jax_hopper.dispatch(policy):
            text = cuda_text(lambda x, w, b: jax_hopper.dense(x, w, b, activation=activation), x, w, b)
    assert "sdy.manual_computation" in text
    if fused:
        assert _fused_calls(text) == 1 and "stablehlo.dot_general" not in text
    else:
        rows = LAYER_ROWS // SHARD_MESH_SIZE
        assert _fused_calls(text) == 0 and _custom_call_kinds(text) == []
        assert len(re.findall(rf"stablehlo\.dot_general.*-> tensor<{rows}x{LAYER_N}xf16>", text)) == 1


@pytest.mark.parametrize("rules, fused", [(True, False), (False, True)])
def test_auto_axes_fused_layers_pick_their_kind_per_device(rules, fused):
    """Auto mesh axes: the per-device body _dense_partition returns, lowered for CUDA on
    its 2048-row shards, is jnp's tanh-GELU layer where the rules picked the fused kind
    for the whole layer, and the fused kind where it was forced (policy "kernel")."""
    from jax_hopper.primitives.dense import _cuda_impl
    from jax_hopper.primitives.dense import _partition as _dense_partition

    mm = _shard_mesh(AxisType.Auto)
    x, w, b = _layer_operands(mm, P("x", None))
    absent = jax.ShapeDtypeStruct((0,), jnp.float16, sharding=NamedSharding(mm, P()))
    result = jax.ShapeDtypeStruct((LAYER_ROWS, LAYER_N), jnp.float16, sharding=NamedSharding(mm, P("x", None)))
    _, per_device, out_sharding, _ = _dense_partition(_cuda_impl, "gelu_tanh", True, False, rules, mm,
                                                      (x, w, b, absent), result)
    assert out_sharding.spec == P("x", None)
    rows = LAYER_ROWS // SHARD_MESH_SIZE
    shards = [jax.ShapeDtypeStruct(shape, jnp.float16) for shape in ((rows, LAYER_K), w.shape, b.shape, (0,))]
    text = cuda_text(per_device, *shards)
    if fused:
        assert _fused_calls(text) == 1 and "stablehlo.dot_general" not in text
    else:
        assert _fused_calls(text) == 0 and re.search(rf"stablehlo\.dot_general.*-> tensor<{rows}x{LAYER_N}xf16>", text)


@pytest.mark.parametrize("rules, want", [(True, "xla"), (False, "persistent")])
def test_a_fused_layer_with_k_split_asks_the_rules_for_its_partial_sums(rules, want):
    """A K-split layer multiplies into f32 partial sums on each device (the epilogue then
    runs on their sum): where the rules picked the layer's kind they are asked about those
    products too, as for a plain K-split product (XLA's dot at 8192x8192x1024 with an f32
    result, never measured on our kernel); a forced kind keeps our default kernel. (jax
    refuses a K split under explicit axes in jnp.dot, so ops.dense does too: the primitive
    is bound directly.)"""
    from jax_hopper.primitives.dense import fused_dense
    KERNELS = kernel_ids()

    mm = _shard_mesh(AxisType.Explicit)
    x, w, b = _layer_operands(mm, P(None, "x"), P("x", None))
    with use_mesh(mm):
        text = cuda_text(lambda x, w, b: fused_dense(x, w, b, activation="gelu_tanh", rules=rules), x, w, b)
    assert "stablehlo.all_reduce" in text and _fused_calls(text) == 0  # the epilogue runs on the sum
    if want == "xla":
        assert _custom_call_kinds(text) == [] and re.search(r"stablehlo\.dot_general.*-> tensor<\d+x\d+xf32>", text)
    else:
        assert _custom_call_kinds(text) == [KERNELS[want]] and "stablehlo.dot_general" not in text


def test_partitioned_products_pass_each_device_its_shards_and_the_rules_flag():
    """On Auto mesh axes custom_partitioning plans the shards inside XLA, after lowering:
    its per-device body must still get the shards' shapes and the `rules` flag, which
    _primitive._cuda_impl reads to pick each device's kind. A stand-in local product
    records what it is given (and computes XLA's dot), compiled for these CPU devices."""
    from jax_hopper._kernels import DEFAULT_KIND as DEFAULT_KERNEL
    from jax_hopper._kernels import stages_of
    from jax_hopper._reference import gemm_reference
    from jax_hopper.primitives.gemm import _partitioned as partitioned

    seen = []

    def local(a, b, *, transpose_a, transpose_b, out_dtype, kernel, stages, rules):
        seen.append((a.shape, b.shape, kernel, rules))
        return gemm_reference(a, b, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)

    mm = mesh()
    product = partitioned(local)
    a = jax.device_put(_random(jax.random.key(40), (M, K)), NamedSharding(mm, P("x", None)))
    b = jax.device_put(_random(jax.random.key(41), (K, N)), NamedSharding(mm, P(None, "y")))
    for rules in (False, True):
        seen.clear()
        f = jax.jit(lambda x, y: product(x, y, transpose_a=False, transpose_b=False, out_dtype=jnp.dtype(jnp.float16),
                                         kernel=DEFAULT_KERNEL, stages=stages_of(DEFAULT_KERNEL), rules=rules))
        out = f(a, b)
        local_shapes = ((M // MESH_SHAPE[0], K), (K, N // MESH_SHAPE[1]))
        assert (*local_shapes, DEFAULT_KERNEL, rules) in seen, seen
        assert_same_product(out, jnp.matmul(a, b), a, b, DN)


def test_partitioned_fused_layers_pass_each_device_its_shards_and_the_rules_flag():
    """As for plain products: custom_partitioning's per-device body of a fused layer gets
    its shards' shapes and the `rules` flag, which _fused._cuda_impl reads (a stand-in
    records them and computes the reference arithmetic on these CPU devices)."""
    from jax_hopper._reference import dense_reference
    from jax_hopper.primitives.dense import _partitioned as dense_partitioned

    seen = []

    def local(x, w, bias, residual, *, activation, has_bias, has_residual, rules):
        seen.append((x.shape, w.shape, rules))
        return dense_reference(x, w, bias if has_bias else None, residual if has_residual else None,
                               activation=activation)

    mm = mesh()
    layer = dense_partitioned(local)
    x = jax.device_put(_random(jax.random.key(42), (M, K)), NamedSharding(mm, P("x", None)))
    w = jax.device_put(_random(jax.random.key(43), (K, N)), NamedSharding(mm, P(None, "y")))
    b = jax.device_put(_random(jax.random.key(44), (N,)), NamedSharding(mm, P("y")))
    absent = jnp.zeros((0,), jnp.float16)
    for rules in (False, True):
        seen.clear()
        out = jax.jit(lambda x, w, b: layer(x, w, b, absent, activation="silu", has_bias=True, has_residual=False,
                                            rules=rules))(x, w, b)
        assert ((M // MESH_SHAPE[0], K), (K, N // MESH_SHAPE[1]), rules) in seen, seen
        ref = dense_reference(x, w, b, None, activation="silu")
        assert relative_error(out, ref.astype(jnp.float32)) < 1e-3  # the same arithmetic, by shards


def test_grad_under_sharding_matches_jnp():
    mm = mesh()
    a = jax.device_put(_random(jax.random.key(2), (M, K)), NamedSharding(mm, P("x", "y")))
    b = jax.device_put(_random(jax.random.key(3), (K, N)), NamedSharding(mm, P("y", None)))

    def loss(f):
        return jax.jit(jax.grad(lambda x, y: jnp.sum(f(x, y).astype(jnp.float32) ** 2), argnums=(0, 1)))

    for g_ours, g_ref in zip(loss(jax_hopper.matmul)(a, b), loss(jnp.matmul)(a, b)):
        assert relative_error(g_ours, g_ref.astype(jnp.float32)) < 1e-2


def test_inside_shard_map_with_replicated_weights_and_grad():
    mm = mesh()
    a = _random(jax.random.key(4), (M, K))
    w = _random(jax.random.key(5), (K, N))

    def block(f):
        body = jax.shard_map(lambda x, y: f(x, y), mesh=mm, in_specs=(P("x", None), P()), out_specs=P("x", None))
        return jax.jit(jax.value_and_grad(lambda x, y: jnp.sum(body(x, y).astype(jnp.float32) ** 2), argnums=(0, 1)))

    (v1, (da1, dw1)), (v2, (da2, dw2)) = block(jax_hopper.matmul)(a, w), block(jnp.matmul)(a, w)
    assert abs(float(v1) - float(v2)) <= 1e-2 * abs(float(v2))
    assert relative_error(da1, da2.astype(jnp.float32)) < 1e-2
    assert relative_error(dw1, dw2.astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("layer", ["matmul", "dense"])
def test_partly_manual_shard_map_partitions_the_free_axis_like_jnp(axis_type, layer):
    """A shard_map manual over "x" only (pipeline stages, say) with "y" left to the
    compiler: custom_partitioning is not consulted there, and our custom call had its
    operands gathered over "y" (a column-parallel W gathered whole, a K split gathered on
    both operands) where jnp.dot communicates nothing or one all-reduce."""
    mm = mesh(axis_type)
    x = _random(jax.random.key(40), (B, M, K))
    w = _random(jax.random.key(41), (K, N)) / 8
    ours_fn = {"matmul": jax_hopper.matmul, "dense": lambda x, w: jax_hopper.dense(x, w, activation="gelu_tanh")}[layer]
    jnp_fn = {"matmul": jnp.matmul, "dense": lambda x, w: jax.nn.gelu(x @ w)}[layer]
    # Column-parallel always; a K split on Auto axes only (explicit axes make jnp itself
    # refuse a contraction over a sharded dim without an out_sharding).
    cases = [(P(None, None, None), P(None, "y"))]
    if axis_type == AxisType.Auto:
        cases.append((P(None, None, "y"), P("y", None)))
    with use_mesh(mm):
        for sx, sw in cases:
            xs = jax.device_put(x, NamedSharding(mm, sx))
            ws = jax.device_put(w, NamedSharding(mm, sw))
            stage = lambda fn: jax.jit(jax.shard_map(  # noqa: E731
                fn, mesh=mm, in_specs=(P(), P()), out_specs=P(), axis_names={"x"}))
            ours_stage, jnp_stage = stage(ours_fn), stage(jnp_fn)
            ours, ref = ours_stage(xs, ws), jnp_stage(xs, ws)
            want = jnp_fn(x.astype(jnp.float32), w.astype(jnp.float32))
            assert relative_error(ours, want) < 1e-2, (sx, sw)
            assert relative_error(ref, want) < 1e-2, (sx, sw)
            got = _collectives(ours_stage.lower(xs, ws).compile().as_text())
            expected = _collectives(jnp_stage.lower(xs, ws).compile().as_text())
            assert got == expected, (sx, sw, got, expected)
            # The derivative's products lower the same way (and their sums agree).
            loss = lambda stage: jax.jit(jax.grad(  # noqa: E731
                lambda x, w: jnp.sum(stage(x, w).astype(jnp.float32) ** 2), argnums=(0, 1)))
            for g_ours, g_ref in zip(loss(ours_stage)(xs, ws), loss(jnp_stage)(xs, ws)):
                assert relative_error(g_ours, g_ref.astype(jnp.float32)) < 1e-2, (sx, sw)


@pytest.mark.parametrize("policy", ["auto", "kernel"])
@pytest.mark.parametrize("result", [jnp.float16, jnp.float32], ids=["f16-result", "f32-result"])
@pytest.mark.parametrize("wrt", ["x", "w"])
def test_jitted_hvp_with_an_untyped_tangent_behaves_like_jnp(wrt, result, policy):
    """A Hessian-vector product under explicit mesh axes whose direction is a fresh array
    (typed without the primal's mesh axes), jitted: it runs where jnp's runs, with jnp's
    result type and values, and where jnp refuses (a sharded contraction) so do we."""
    mm = mesh(AxisType.Explicit)
    x0, w0 = _random(jax.random.key(50), (M, K)), _random(jax.random.key(51), (K, N)) / 8
    v = _random(jax.random.key(52), (M, K) if wrt == "x" else (K, N))  # no mesh axes in its type

    def hvp(product):
        def loss(x, w):
            return jnp.sum(jnp.sin(product(x, w, preferred_element_type=result).astype(jnp.float32)))
        if wrt == "x":
            return jax.jit(lambda x, w, v: jax.jvp(lambda a: jax.grad(loss)(a, w), (x,), (v,))[1])
        return jax.jit(lambda x, w, v: jax.jvp(lambda b: jax.grad(loss, argnums=1)(x, b), (w,), (v,))[1])

    # The f32 computation, on one device (XLA's partitioning is not under test in it).
    with full_f32():
        want = hvp(lambda a, b, **kw: jnp.matmul(a, b))(*(a.astype(jnp.float32) for a in (x0, w0, v)))
    with use_mesh(mm), \
            jax_hopper.dispatch(policy):
        for sx, sw in [(P("x", None), P()), (P(), P(None, "y")), (P("x", None), P(None, "y")),
                       (P(None, "y"), P("y", None))]:  # the last: a sharded K, which jnp refuses
            x, w = jax.device_put(x0, NamedSharding(mm, sx)), jax.device_put(w0, NamedSharding(mm, sw))
            try:
                ref = hvp(jnp.matmul)(x, w, v)
            except Exception as e:  # noqa: BLE001 -- whatever jnp raises, we must raise too
                with pytest.raises(type(e)):
                    hvp(jax_hopper.matmul)(x, w, v)
                continue
            ours = hvp(jax_hopper.matmul)(x, w, v)
            assert jax.typeof(ours) == jax.typeof(ref), (sx, sw, jax.typeof(ours), jax.typeof(ref))
            # Three rounded products deep (forward, backward, tangent): jnp's error against
            # the f32 computation bounds ours, with the factor the other chained tests use.
            assert relative_error(ours, want) <= 2 * max(relative_error(ref, want), 2.0**-11), (sx, sw)


def test_explicit_axis_types_behave_like_jnp():
    mm = mesh(AxisType.Explicit)
    a = _random(jax.random.key(6), (M, K))
    b = _random(jax.random.key(7), (K, N))
    with use_mesh(mm):
        for sa, sb in [(P("x", None), P()), (P(), P(None, "x")), (P("x", None), P(None, "y"))]:
            a_s = jax.device_put(a, NamedSharding(mm, sa))
            b_s = jax.device_put(b, NamedSharding(mm, sb))
            f = jax.jit(jax_hopper.matmul)
            ours, ref = f(a_s, b_s), jax.jit(jnp.matmul)(a_s, b_s)
            # The result's type carries jnp.dot's sharding, so nothing is gathered to fit it.
            assert ours.sharding.is_equivalent_to(ref.sharding, 2), (sa, sb, ours.sharding, ref.sharding)
            assert _collectives(f.lower(a_s, b_s).compile().as_text())["all-gather"] == 0
            np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32), rtol=2**-9,
                                       atol=2**-9)
        # A sharded contracting dimension needs out_sharding, for jnp and for us alike.
        a_k = jax.device_put(a, NamedSharding(mm, P(None, "x")))
        b_k = jax.device_put(b, NamedSharding(mm, P("x", None)))
        with pytest.raises(Exception, match="out_sharding"):
            jax.jit(jnp.matmul)(a_k, b_k)
        with pytest.raises(Exception, match="out_sharding"):
            jax.jit(jax_hopper.matmul)(a_k, b_k)
        # Raised by our own validation, before any kernel is chosen (on GPUs the kernel
        # path once took such operands and XLA aborted compiling the partitioned call).
        with pytest.raises(Exception, match="out_sharding"):
            jax_hopper.dispatch_path(a_k, b_k, DN)
        with pytest.raises(Exception, match="out_sharding"):
            jax_hopper.dispatch_path(*(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in (a_k, b_k)),
                                     DN)
        out = jax.jit(lambda x, y: jax_hopper.matmul(x, y, out_sharding=P()))(a_k, b_k)
        want = jax.jit(lambda x, y: jnp.matmul(x, y, out_sharding=P()))(a_k, b_k)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
        # Attention scores with the heads sharded: each batch dim keeps its sharding in the
        # type (jax refused the fold of several batch dims into one, so jax ran these).
        q = jax.device_put(_random(jax.random.key(8), (2, B, M, K)), NamedSharding(mm, P(None, "x")))
        kt = jax.device_put(_random(jax.random.key(9), (2, B, K, N)), NamedSharding(mm, P(None, "x")))
        f = jax.jit(jax_hopper.matmul)
        ours, ref = f(q, kt), jax.jit(jnp.matmul)(q, kt)
        assert "jax_hopper_gemm" in str(jax.make_jaxpr(jax_hopper.matmul)(q, kt))  # ours, not jax's
        assert ours.sharding.is_equivalent_to(ref.sharding, 4), (ours.sharding, ref.sharding)
        assert _collectives(f.lower(q, kt).compile().as_text())["all-gather"] == 0
        assert_same_product(ours, ref, q, kt, (((3,), (2,)), ((0, 1), (0, 1))))


DENSE_PATTERNS = {  # name: (x spec, w spec) for x [M, K] @ w [K, N]
    "M_sharded": (P("x", None), P()),
    "N_sharded": (P(), P(None, "x")),
    "M_and_N": (P("x", None), P(None, "y")),
    "K_sharded": (P(None, "x"), P("x", None)),
}


@pytest.mark.parametrize("pattern", DENSE_PATTERNS)
def test_fused_dense_partitions_like_the_unfused_block(pattern):
    from layer_cases import assert_close_to_reference

    sx, sw = DENSE_PATTERNS[pattern]
    mm = mesh()
    kx, kw, kb, kr = jax.random.split(jax.random.key(len(pattern)), 4)
    x = jax.device_put(_random(kx, (M, K)), NamedSharding(mm, sx))
    w = jax.device_put(_random(kw, (K, N)) / 8, NamedSharding(mm, sw))
    b, r = _random(kb, (N,)), _random(kr, (M, N))
    ours = jax.jit(lambda x, w, b, r: jax_hopper.dense(x, w, b, activation="gelu_tanh", residual=r))
    plain = jax.jit(lambda x, w, b, r: jax.nn.gelu(x @ w + b) + r)
    with jax_hopper.dispatch("kernel"):
        out = ours(x, w, b, r)
        text = ours.lower(x, w, b, r).compile().as_text()
    ref = plain(x, w, b, r)
    assert_close_to_reference(out, x, w, b, r, "gelu_tanh")
    assert out.sharding.is_equivalent_to(ref.sharding, 2), (out.sharding, ref.sharding)
    got, want = _collectives(text), _collectives(plain.lower(x, w, b, r).compile().as_text())
    assert got["all-gather"] <= want["all-gather"] and got["all-reduce"] == want["all-reduce"], (got, want)
    if ON_GPU:  # a sharded K needs the whole sum before the epilogue: plain GEMM + psum
        target = "jax_hopper_gemm" if pattern == "K_sharded" else "jax_hopper_gemm_fused"
        assert f'custom_call_target="{target}"' in text


def test_fused_dense_inside_shard_map_with_replicated_weights_and_grad():
    mm = mesh()
    x = _random(jax.random.key(10), (M, K))
    w = _random(jax.random.key(11), (K, N)) / 8
    b = _random(jax.random.key(12), (N,))

    def block(layer):
        body = jax.shard_map(layer, mesh=mm, in_specs=(P("x", None), P(), P()), out_specs=P("x", None))
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(body(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))

    ours = block(lambda x, w, b: jax_hopper.dense(x, w, b, activation="silu"))
    ref = block(lambda x, w, b: jax.nn.silu(x.astype(jnp.float32) @ w.astype(jnp.float32) + b.astype(jnp.float32)))
    with jax_hopper.dispatch("kernel"):
        (v1, g1) = ours(x, w, b)
    (v2, g2) = ref(x, w, b)
    assert abs(float(v1) - float(v2)) <= 1e-2 * abs(float(v2))
    for a, c in zip(g1, g2):
        assert relative_error(a, c.astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("policy", ["kernel", "xla"])
def test_mlp_inside_shard_map_with_replicated_weights_and_grad(policy):
    """The block's custom VJP returns the replicated weights' and biases' cotangents
    summed over the axis x is split on, as jax's own autodiff of the jnp block does
    (it raised a type error before: each device's partial gradient varies over x)."""
    mm = mesh()
    x = _random(jax.random.key(20), (M, K))
    w1, w2 = _random(jax.random.key(21), (K, N)) / 8, _random(jax.random.key(22), (N, K)) / 8
    b1, b2 = _random(jax.random.key(23), (N,)), _random(jax.random.key(24), (K,))

    def grads(block):
        body = jax.shard_map(block, mesh=mm, in_specs=(P("x", None), P(), P(), P(), P()), out_specs=P("x", None))
        return jax.jit(jax.grad(lambda *a: jnp.sum(body(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4)))

    def plain(x, w1, b1, w2, b2):
        f32 = [v.astype(jnp.float32) for v in (x, w1, b1, w2, b2)]
        return jax.nn.gelu(f32[0] @ f32[1] + f32[2], approximate=True) @ f32[3] + f32[4] + f32[0]

    with jax_hopper.dispatch(policy):
        mine = grads(lambda *a: jax_hopper.mlp(*a, activation="gelu_tanh", residual=a[0]))(x, w1, b1, w2, b2)
    ref = grads(plain)(x, w1, b1, w2, b2)
    for a, c in zip(mine, ref):
        assert a.shape == c.shape and relative_error(a, c.astype(jnp.float32)) < 2e-2


def test_derivative_on_xla_keeps_explicit_shardings():
    """A forward product on our kernel whose derivative the dispatcher sends to XLA's dot:
    dW contracts over the sharded M, which under explicit axes needs the operand's
    out_sharding, as jax's own dot transpose passes it."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        a = jax.device_put(_random(jax.random.key(8), (M, K)), NamedSharding(mm, P("x", None)))
        w = jax.device_put(_random(jax.random.key(9), (K, N)), NamedSharding(mm, P()))

        def loss(mm_fn, policy):
            def f(x, y):
                with jax_hopper.dispatch(policy):
                    c = mm_fn(x, y)
                return jnp.sum(c.astype(jnp.float32) ** 2)
            return f

        with jax_hopper.dispatch("auto"):  # the derivative is traced here: XLA's dot for every product
            grad = jax.jit(jax.grad(loss(jax_hopper.matmul, "kernel"), argnums=(0, 1)))
            text = grad.trace(a, w).lower(lowering_platforms=("cuda",)).as_text()
            # The forward on our kernel (explicit axes: each device's product in a
            # shard_map), both derivative products on XLA's dot.
            assert re.findall(r"custom_call @(\S+)\(", text) == ["jax_hopper_gemm"]
            assert "sdy.manual_computation" in text
            assert len(re.findall(r"stablehlo\.dot_general", text)) == 2
            if ON_GPU:
                ga, gw = grad(a, w)
                ra, rw = jax.jit(jax.grad(loss(jnp.matmul, "auto"), argnums=(0, 1)))(a, w)
                assert ga.sharding.is_equivalent_to(ra.sharding, 2) and gw.sharding.is_equivalent_to(rw.sharding, 2)
                assert relative_error(ga, ra.astype(jnp.float32)) < 1e-2
                assert relative_error(gw, rw.astype(jnp.float32)) < 1e-2


def test_unevenly_sharded_contraction_is_gathered_not_summed_with_padding():
    """K = 62 over a 4-way axis: the last shard is padded, and summing the padding into
    the product gave the K = 64 answer silently. Such a K is gathered (M, N and batch
    padding only adds rows or columns that are cut away)."""
    m = mesh()
    ka, kb = jax.random.split(jax.random.key(7))
    a = jax.device_put(_random(ka, (M, K)), NamedSharding(m, P(None, "x")))
    b = jax.device_put(_random(kb, (K, N)), NamedSharding(m, P("x", None)))
    assert K % MESH_SHAPE[0] == 0
    k_uneven = K - 1  # not a multiple of any axis size >= 2 that divides K
    f = lambda mm: jax.jit(lambda x, y: mm(x[:, :k_uneven], y[:k_uneven]))  # noqa: E731
    ours, ref = f(jax_hopper.matmul)(a, b), f(jnp.matmul)(a, b)
    exact = np.asarray(a, np.float32)[:, :k_uneven] @ np.asarray(b, np.float32)[:k_uneven]
    assert relative_error(ours, exact) <= 1.5 * relative_error(ref, exact) + 1e-6
    w_bias = jnp.zeros((N,), jnp.float16) + 0.5
    dense = jax.jit(lambda x, w: jax_hopper.dense(x[:, :k_uneven], w[:k_uneven], w_bias, activation="relu"))(a, b)
    dense_ref = np.maximum(exact + 0.5, 0)
    assert relative_error(dense, dense_ref) < 1e-2


@pytest.mark.parametrize("policy", ["auto", "kernel", "xla"])
def test_explicit_product_whose_plan_jax_cannot_type_is_jaxs(policy):
    """Typing the plan's reshape of b [261, 332@y, 1, 5] raised an IndexError in jax 0.10
    (not the ShardingTypeError _explicit_reshape_refused caught), so dot_general raised
    where lax.dot_general computes (found by tests/fuzz.py); now jax computes it."""
    mm = mesh(AxisType.Explicit)
    dims = (((0, 3), (0, 3)), ((), ()))
    with use_mesh(mm):
        a = jax.device_put(_random(jax.random.key(856), (261, 1, 15, 5), jnp.bfloat16), NamedSharding(mm, P()))
        b = jax.device_put(_random(jax.random.key(857), (261, 2 * MESH_SHAPE[1] * 83, 1, 5), jnp.bfloat16),
                           NamedSharding(mm, P(None, "y")))
        with jax_hopper.dispatch(policy):
            ours = jax.jit(lambda x, y: jax_hopper.dot_general(x, y, dims))(a, b)
        ref = jax.jit(lambda x, y: lax.dot_general(x, y, dims))(a, b)
    assert jax.typeof(ours) == jax.typeof(ref), (jax.typeof(ours), jax.typeof(ref))
    assert_same_product(ours, ref, a, b, dims)


def test_explicit_batch_sharded_on_one_operand_differentiates_like_lax():
    """The other operand's gradient comes out of our kernel batch-sharded like the
    cotangent; jax wants its primal's type (it raised 'Expected cotangent type').
    Newer jax (0.11) refuses the product itself (batch dims sharded differently): then
    ours must refuse it the same way."""
    mm = mesh(AxisType.Explicit)
    dn = (((2,), (1,)), ((0,), (0,)))

    def grads(f, a, b):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w, dn).astype(jnp.float32) ** 2), argnums=(0, 1)))(a, b)

    def both(a, b):
        try:
            ref = grads(lax.dot_general, a, b)
        except Exception as e:  # jax's own sharding type check: ours must raise the same
            with pytest.raises(type(e), match="same sharding"):
                grads(jax_hopper.dot_general, a, b)
            return None
        return grads(jax_hopper.dot_general, a, b), ref

    with use_mesh(mm):
        a = jax.device_put(_random(jax.random.key(8), (B, M, K)), NamedSharding(mm, P("x")))
        b = jax.device_put(_random(jax.random.key(9), (B, K, N)), NamedSharding(mm, P()))
        results = [both(a, b)]
    # Arrays on an explicit mesh outside its context: the reshard must name the mesh.
    results.append(both(a, b))
    results = [r for r in results if r is not None]
    for ours, ref in results:
        for go, gr in zip(ours, ref):
            assert jax.typeof(go) == jax.typeof(gr), (jax.typeof(go), jax.typeof(gr))
            assert relative_error(go, gr.astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("operand", ["x", "w", "bias"])
def test_explicit_affine_dense_transposes_like_jnp(operand):
    """jax.linear_transpose through an affine dense under explicit axes: the cotangent keeps
    its operand's type (the transpose rule once rebuilt the operand without its sharding,
    and jax refused the cotangent)."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        ops = {"x": jax.device_put(_random(jax.random.key(12), (M, K)), NamedSharding(mm, P("x", None))),
               "w": jax.device_put(_random(jax.random.key(13), (K, N)), NamedSharding(mm, P(None, "y"))),
               "bias": jax.device_put(_random(jax.random.key(14), (N,)), NamedSharding(mm, P("y")))}
        ct = jax.device_put(_random(jax.random.key(15), (M, N)), NamedSharding(mm, P("x", "y")))

        def layer(fn):
            return lambda v: fn(*[v if name == operand else ops[name] for name in ops])

        with jax_hopper.dispatch("kernel"):
            (ours,) = jax.jit(jax.linear_transpose(layer(jax_hopper.dense), ops[operand]))(ct)
        (ref,) = jax.linear_transpose(layer(lambda x, w, b: x @ w + b), ops[operand])(ct)
        assert jax.typeof(ours) == jax.typeof(ref), (jax.typeof(ours), jax.typeof(ref))
        assert relative_error(ours, ref.astype(jnp.float32)) < 1e-2


def test_explicit_dense_result_type_follows_jnp():
    """The fused dense's result type under explicit axes: M as x, N as w (it copied x's
    sharding, putting K's mesh axis on N); a sharded K asks for out_sharding like jnp."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        x = jax.device_put(_random(jax.random.key(10), (M, K)), NamedSharding(mm, P("x", None)))
        w = jax.device_put(_random(jax.random.key(11), (K, N)), NamedSharding(mm, P(None, "y")))
        ours = jax.jit(lambda x, w: jax_hopper.dense(x, w, activation="relu"))(x, w)
        ref = jax.jit(lambda x, w: jax.nn.relu(x @ w))(x, w)
        assert jax.typeof(ours) == jax.typeof(ref), (jax.typeof(ours), jax.typeof(ref))
        assert relative_error(ours, ref.astype(jnp.float32)) < 1e-2
        x_k = jax.device_put(x, NamedSharding(mm, P(None, "x")))
        w_k = jax.device_put(w, NamedSharding(mm, P("x", None)))
        with pytest.raises(Exception, match="out_sharding"):
            jax.jit(lambda x, w: x @ w)(x_k, w_k)
        with pytest.raises(Exception, match="out_sharding"):
            jax.jit(lambda x, w: jax_hopper.dense(x, w))(x_k, w_k)


def test_explicit_sequence_sharded_activations_keep_their_sharding():
    """x [B, S, K] with S sharded: folding B and S into M before the primitive is a
    reshape that cannot keep S's explicit sharding (jax raised). The primitive keeps x's
    leading dims (folding them per device), so the product stays on the kernel with
    jnp's result type. A fold that would still drop a sharding (the rhs's free dims
    [K, N1, N2] with N2 sharded) runs jax's own dot."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        x = jax.device_put(_random(jax.random.key(12), (B, M, K)), NamedSharding(mm, P(None, "x")))
        w = jax.device_put(_random(jax.random.key(13), (K, N)), NamedSharding(mm, P()))
        ref = jax.jit(jnp.matmul)(x, w)
        for f in (jax_hopper.matmul, jax_hopper.dot, lambda a, b: jax_hopper.dense(a, b)):
            ours = jax.jit(f)(x, w)
            assert jax.typeof(ours) == jax.typeof(ref), (jax.typeof(ours), jax.typeof(ref))
            assert relative_error(ours, ref.astype(jnp.float32)) < 1e-2
        assert jax_hopper.dispatch_path(x, w, (((2,), (0,)), ((), ())))[0] == "kernel"
        w3 = jax.device_put(_random(jax.random.key(14), (K, 4, N // 4)), NamedSharding(mm, P(None, None, "x")))
        x2 = jax.device_put(_random(jax.random.key(15), (M, K)), NamedSharding(mm, P()))
        dn = (((1,), (0,)), ((), ()))
        assert jax_hopper.dispatch_path(x2, w3, dn)[0] == "jax"
        ours = jax.jit(lambda a, b: jax_hopper.dot_general(a, b, dn))(x2, w3)
        ref3 = jax.jit(lambda a, b: lax.dot_general(a, b, dn))(x2, w3)
        assert jax.typeof(ours) == jax.typeof(ref3)
        x_lead = jax.device_put(x, NamedSharding(mm, P("x")))
        assert jax_hopper.dispatch_path(x_lead, w, (((2,), (0,)), ((), ())))[0] == "kernel"
        assert jax.typeof(jax.jit(jax_hopper.matmul)(x_lead, w)) == jax.typeof(jax.jit(jnp.matmul)(x_lead, w))


def test_explicit_sequence_sharded_gradients_and_residuals_follow_jnp():
    """x [B, S@x, K]: dW contracts B and S, which folding cannot do with S sharded
    (jax raised 'reshape is not supported'): one dot_general contracts them. A residual
    sharded unlike x @ w makes jnp's sum combine the shardings: that layer runs jnp's
    computation, so the result type is jnp's."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        x = jax.device_put(_random(jax.random.key(40), (B, M, K)), NamedSharding(mm, P(None, "x")))
        w = jax.device_put(_random(jax.random.key(41), (K, N)), NamedSharding(mm, P()))
        r = jax.device_put(_random(jax.random.key(42), (B, M, N)), NamedSharding(mm, P(None, None, "y")))
        gelu_dense = lambda x, w: jax_hopper.dense(x, w, activation="gelu_tanh")  # noqa: E731
        for f, ref_f in [(jax_hopper.matmul, jnp.matmul), (gelu_dense, lambda x, w: jax.nn.gelu(x @ w))]:
            loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2)  # noqa: E731
            ours = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
            ref = jax.jit(jax.grad(loss(ref_f), argnums=(0, 1)))(x, w)
            for go, gr in zip(ours, ref):
                assert jax.typeof(go) == jax.typeof(gr), (jax.typeof(go), jax.typeof(gr))
                assert relative_error(go, gr.astype(jnp.float32)) < 2e-2
        ours = jax.jit(lambda x, w, r: jax_hopper.dense(x, w, activation="relu", residual=r))(x, w, r)
        ref = jax.jit(lambda x, w, r: jax.nn.relu(x @ w) + r)(x, w, r)
        assert jax.typeof(ours) == jax.typeof(ref), (jax.typeof(ours), jax.typeof(ref))
        assert relative_error(ours, ref.astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_explicit_mesh_gradients_with_a_sharded_contraction_in_the_backward(policy):
    """x [M@x, K] @ w [K, N@y]: dW = x^T dC contracts the sharded M. Under policy
    "kernel" where XLA's dot stands in for the kernel (CPU devices, a GPU that is not a
    Hopper) that dot raised jax's 'Contracting dimensions are sharded' (it lacked the
    result's sharding); on Hopper GPUs our kernel runs it."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        a = jax.device_put(_random(jax.random.key(20), (M, K)), NamedSharding(mm, P("x", None)))
        b = jax.device_put(_random(jax.random.key(21), (K, N)), NamedSharding(mm, P(None, "y")))

        def grads(mm_fn):
            loss = lambda x, w: jnp.sum(mm_fn(x, w).astype(jnp.float32) ** 2)  # noqa: E731
            return jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)

        with jax_hopper.dispatch(policy):
            ours = grads(jax_hopper.matmul)
        ref = grads(jnp.matmul)
    for go, gr in zip(ours, ref):
        assert jax.typeof(go) == jax.typeof(gr), (jax.typeof(go), jax.typeof(gr))
        assert relative_error(go, gr.astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_explicit_matmul_against_a_batch_it_broadcasts_over_keeps_the_batch_sharding(policy):
    """W [M, K] (or a vector [K]) @ x [B@x, K, N]: the result keeps x's batch sharding
    with no collective, as jnp's. W broadcast to [B, M, K] as a replicated copy gave a
    replicated result and an all-gather."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        x = jax.device_put(_random(jax.random.key(91), (B, K, N)), NamedSharding(mm, P("x", None, None)))
        for w_shape in ((M, K), (K,)):
            w = jax.device_put(_random(jax.random.key(90), w_shape), NamedSharding(mm, P()))
            with jax_hopper.dispatch(policy):
                f = jax.jit(jax_hopper.matmul)
                ours, text = f(w, x), f.lower(w, x).compile().as_text()
            ref_f = jax.jit(jnp.matmul)
            ref = ref_f(w, x)
            assert jax.typeof(ours) == jax.typeof(ref), (jax.typeof(ours), jax.typeof(ref))
            assert _collectives(text) == _collectives(ref_f.lower(w, x).compile().as_text())
            assert relative_error(ours, ref.astype(jnp.float32)) <= 2**-9


OUR_CUSTOM_CALLS = ("jax_hopper_gemm", "jax_hopper_gemm_fused", "jax_hopper_gemm_fused_grad",
                    "jax_hopper_gemm_fused_derivative")


def test_sharded_products_on_auto_axes_export_and_run_like_jnp():
    """jax.export of a program spanning devices on Auto mesh axes: custom_partitioning's
    callbacks cannot be serialized (jax raised 'serialization of host_callbacks is not yet
    implemented'), so the exported program holds XLA's dot, partitioned like jnp's; it
    runs and gives jnp's values and shardings."""
    from jax import export

    mm = mesh()
    sa, sb = NamedSharding(mm, P("x", None)), NamedSharding(mm, P(None, "y"))
    a = jax.device_put(_random(jax.random.key(80), (M, K)), sa)
    b = jax.device_put(_random(jax.random.key(81), (K, N)), sb)
    bias = jax.device_put(_random(jax.random.key(82), (N,)), NamedSharding(mm, P("y")))
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in OUR_CUSTOM_CALLS]
    cases = [(jax_hopper.matmul, jnp.matmul, (a, b)),
             (lambda x, w, c: jax_hopper.dense(x, w, c, activation="gelu_tanh"),
              lambda x, w, c: jax.nn.gelu(x @ w + c), (a, b, bias)),
             (jax.grad(lambda x, w: jnp.sum(jax_hopper.matmul(x, w).astype(jnp.float32)), argnums=(0, 1)),
              jax.grad(lambda x, w: jnp.sum(jnp.matmul(x, w).astype(jnp.float32)), argnums=(0, 1)), (a, b))]
    for ours, theirs, args in cases:
        specs = [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for v in args]
        shardings = tuple(v.sharding for v in args)
        with jax_hopper.dispatch("kernel"):
            exp = export.export(jax.jit(ours, in_shardings=shardings), platforms=("cpu", "cuda"),
                                disabled_checks=checks)(*specs)
        assert not any(f"custom_call @{t}(" in exp.mlir_module() for t in OUR_CUSTOM_CALLS)
        ref = jax.jit(theirs)(*args)
        for got, want in zip(jax.tree.leaves(exp.call(*args)), jax.tree.leaves(ref)):
            assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
            # XLA's dot either way: jnp's values up to the rounding of the f16 results
            assert relative_error(got, want.astype(jnp.float32)) <= 2**-9


def _assert_gradients_follow_jnp(layers, policy, key):
    """For each (ours, jnp's, args) in layers: the gradients of every argument, under
    `policy`, have jnp's types and values. The loss takes a fixed random cotangent, so
    gradients stay far from f16's 65504 and none is amplified."""
    for f, ref_f, args in layers:
        def loss(f):
            def value(*a):
                y = f(*a).astype(jnp.float32)
                return jnp.sum(y * jax.random.normal(key, y.shape, jnp.float32))
            return value

        argnums = tuple(range(len(args)))
        with jax_hopper.dispatch(policy):
            ours = jax.jit(jax.grad(loss(f), argnums=argnums))(*args)
        ref = jax.jit(jax.grad(loss(ref_f), argnums=argnums))(*args)
        for go, gr in zip(ours, ref):
            assert jax.typeof(go) == jax.typeof(gr), (jax.typeof(go), jax.typeof(gr))
            # f16 gradients of f16 products (K, N <= 128 terms, up to B * M rows summed in
            # f32): a few f16 roundings
            assert relative_error(go, gr.astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_explicit_fsdp_layout_gradients_follow_jnp(policy):
    """x [M@x, K] against w [K@x, N] (FSDP: the weights sharded on the data axis): dx =
    dC w^T has dC's rows and w's K on one axis. jax's transpose gives dx x's type; our
    backward product built the result type [M@x, K@x] and raised DuplicateSpecError."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        x = jax.device_put(_random(jax.random.key(70), (M, K)), NamedSharding(mm, P("x", None)))
        w = jax.device_put(_random(jax.random.key(71), (K, N)), NamedSharding(mm, P("x", None)))
        w2 = jax.device_put(_random(jax.random.key(72), (N, K)), NamedSharding(mm, P("x", None)))
        b = jax.device_put(_random(jax.random.key(73), (N,)), NamedSharding(mm, P()))
        b2 = jax.device_put(_random(jax.random.key(74), (K,)), NamedSharding(mm, P()))
        layers = [
            (jax_hopper.matmul, jnp.matmul, (x, w)),
            (lambda x, w, b: jax_hopper.dense(x, w, b, activation="relu"), lambda x, w, b: jax.nn.relu(x @ w + b),
             (x, w, b)),
            (lambda x, w, b, w2, b2: jax_hopper.mlp(x, w, b, w2, b2, activation="gelu_tanh"),
             lambda x, w, b, w2, b2: jax.nn.gelu(x @ w + b) @ w2 + b2, (x, w, b, w2, b2)),
        ]
        _assert_gradients_follow_jnp(layers, policy, jax.random.key(75))


MESHLESS_WEIGHT_CASES = {  # name: (x shape, x spec, which of w1, b1, w2 are sharded (w1 spec, b1 spec))
    "data_parallel": ((M, K), P("x"), None),
    "sequence_sharded": ((B, M, K), P(None, "x"), None),
    "rows_and_k_sharded": ((M, K), P("x", "y"), None),
    "first_layer_on_y": ((M, K), P("x"), (P(None, "y"), P("y"))),
}


@pytest.mark.parametrize("policy", ["kernel", pytest.param("auto", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(MESHLESS_WEIGHT_CASES))
def test_explicit_gradients_of_weights_without_a_mesh_follow_jnp(case, policy):
    """Weights made before entering the mesh (no mesh in their type) next to x sharded on
    explicit axes: jax types them replicated over the current mesh, and so their
    gradients. Ours typed dW's product with the empty mesh: contracting a sharded dim
    was refused (ShardingTypeError), or dW came back sharded unlike its weight."""
    x_shape, x_spec, first_layer = MESHLESS_WEIGHT_CASES[case]
    w1, b1 = _random(jax.random.key(80), (K, N)), _random(jax.random.key(81), (N,))
    w2, b2 = _random(jax.random.key(82), (N, K)), _random(jax.random.key(83), (K,))
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        x = jax.device_put(_random(jax.random.key(84), x_shape), NamedSharding(mm, x_spec))
        if first_layer is not None:
            w1, b1 = (jax.device_put(v, NamedSharding(mm, s)) for v, s in zip((w1, b1), first_layer))
        layers = [
            (lambda x, w1: jax_hopper.matmul(x, w1), lambda x, w1: x @ w1, (x, w1)),
            (lambda x, w1, b1: jax_hopper.dense(x, w1, b1, activation="gelu_tanh"),
             lambda x, w1, b1: jax.nn.gelu(x @ w1 + b1), (x, w1, b1)),
            (lambda *a: jax_hopper.mlp(*a, activation="gelu_tanh"),
             lambda x, w1, b1, w2, b2: jax.nn.gelu(x @ w1 + b1) @ w2 + b2, (x, w1, b1, w2, b2)),
        ]
        _assert_gradients_follow_jnp(layers, policy, jax.random.key(85))


@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_explicit_mesh_context_with_no_operand_on_it_runs_like_jnp(policy):
    """Under an explicit mesh, a layer whose operands all have no mesh in their type: the
    empty stand-in for an absent bias or residual (jnp.zeros) took the mesh's type, so the
    fused layer lowered by the explicit-axes plan, which has no result type to give it
    (ValueError from reshard), forward and backward."""
    x = _random(jax.random.key(90), (M, K))
    w1, b1 = _random(jax.random.key(91), (K, N)), _random(jax.random.key(92), (N,))
    w2 = _random(jax.random.key(93), (N, K))
    layers = [
        (lambda x, w1, b1: jax_hopper.dense(x, w1, b1), lambda x, w1, b1: x @ w1 + b1),
        (lambda x, w1, b1: jax_hopper.dense(x, w1, activation="relu"), lambda x, w1, b1: jax.nn.relu(x @ w1)),
        (lambda x, w1, b1: jax_hopper.dense(x, w1, b1, activation="gelu_tanh"),
         lambda x, w1, b1: jax.nn.gelu(x @ w1 + b1)),
        (lambda x, w1, b1: jax_hopper.mlp(x, w1, b1, w2, None, activation="gelu_tanh"),
         lambda x, w1, b1: jax.nn.gelu(x @ w1 + b1) @ w2),
    ]
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        for f, ref_f in layers:
            for grad in (False, True):
                def step(f):
                    if not grad:
                        return f
                    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) *
                                                       jax.random.normal(jax.random.key(94), (M, f(*a).shape[-1]))),
                                    argnums=(0, 1, 2))
                with jax_hopper.dispatch(policy):
                    ours = jax.tree.leaves(jax.jit(step(f))(x, w1, b1))
                ref = jax.tree.leaves(jax.jit(step(ref_f))(x, w1, b1))
                for got, want in zip(ours, ref):
                    assert jax.typeof(got) == jax.typeof(want), (jax.typeof(got), jax.typeof(want))
                    if not bool(jnp.any(want)):  # the gradient of a bias the layer does not use
                        assert not bool(jnp.any(got))
                        continue
                    # 16-bit results of products of <= 128 terms (f32 sums), a gradient of two
                    # rounded products: a few f16 roundings
                    assert relative_error(got, want.astype(jnp.float32)) < 1e-2


def test_explicit_dense_residual_sharded_unlike_the_product_gets_jnps_type():
    """act(x @ w) + r with r sharded unlike x @ w: jnp's sum combines the shardings; the
    fused kernel's result type is x @ w's, so that layer runs jnp's computation."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        x = jax.device_put(_random(jax.random.key(50), (B, M, K)), NamedSharding(mm, P("x")))
        w = jax.device_put(_random(jax.random.key(51), (K, N)), NamedSharding(mm, P()))
        for r_spec in (P(None, None, "y"), P("x", None, "y"), P("x")):
            r = jax.device_put(_random(jax.random.key(52), (B, M, N)), NamedSharding(mm, r_spec))
            ours = jax.jit(lambda x, w, r: jax_hopper.dense(x, w, activation="relu", residual=r))(x, w, r)
            ref = jax.jit(lambda x, w, r: jax.nn.relu(x @ w) + r)(x, w, r)
            assert jax.typeof(ours) == jax.typeof(ref), (r_spec, jax.typeof(ours), jax.typeof(ref))
            assert relative_error(ours, ref.astype(jnp.float32)) < 1e-2


def test_explicit_operand_next_to_one_without_a_mesh():
    """A constant (or uncommitted) x against w sharded on explicit axes: the plan takes the
    mesh from w and treats x as replicated; the result type is jnp's (N sharded as w)."""
    mm = mesh(AxisType.Explicit)
    x = np.asarray(_random(jax.random.key(60), (M, K)))
    with use_mesh(mm):
        w = jax.device_put(_random(jax.random.key(61), (K, N)), NamedSharding(mm, P(None, "y")))
        for f, ref_f in [(jax_hopper.matmul, jnp.matmul), (lambda a, b: jax_hopper.dense(a, b, activation="relu"),
                                                           lambda a, b: jax.nn.relu(a @ b))]:
            ours = jax.jit(lambda w: f(jnp.asarray(x), w))(w)
            ref = jax.jit(lambda w: ref_f(jnp.asarray(x), w))(w)
            assert jax.typeof(ours) == jax.typeof(ref), (jax.typeof(ours), jax.typeof(ref))
            assert relative_error(ours, ref.astype(jnp.float32)) < 1e-2
        # Only the bias (or residual) typed with the mesh: jnp's sum gives the mesh type.
        w0 = np.asarray(w)
        bias = jax.device_put(_random(jax.random.key(65), (N,)), NamedSharding(mm, P("y")))
        r = jax.device_put(_random(jax.random.key(66), (M, N)), NamedSharding(mm, P()))
        for kw in [dict(bias=bias), dict(residual=r)]:
            ours = jax.jit(lambda kw: jax_hopper.dense(jnp.asarray(x), jnp.asarray(w0), activation="relu", **kw))(kw)
            ref = jax.jit(lambda kw: jax.nn.relu(jnp.asarray(x) @ jnp.asarray(w0) + kw.get("bias", 0))
                          + kw.get("residual", 0))(kw)
            assert jax.typeof(ours) == jax.typeof(ref), (list(kw), jax.typeof(ours), jax.typeof(ref))
            assert relative_error(ours, ref.astype(jnp.float32)) < 1e-2


def test_explicit_vmap_over_weights_with_sequence_sharded_activations():
    """vmap over per-example weights with x [B, S@x, K]: folding S into M is refused by
    jax under explicit axes; the batching rule leaves that product to XLA's dot."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        x = jax.device_put(_random(jax.random.key(62), (B, M, K)), NamedSharding(mm, P(None, "x")))
        ws = jax.device_put(_random(jax.random.key(63), (3, K, N)), NamedSharding(mm, P()))
        ours = jax.jit(jax.vmap(lambda w: jax_hopper.matmul(x, w)))(ws)
        ref = jax.jit(jax.vmap(lambda w: jnp.matmul(x, w)))(ws)
        assert jax.typeof(ours) == jax.typeof(ref), (jax.typeof(ours), jax.typeof(ref))
        assert relative_error(ours, ref.astype(jnp.float32)) < 1e-2


def test_explicit_empty_contraction_is_zeros_of_the_result_type():
    """K = 0 on explicit axes: an empty sum (XLA refuses a shard_map of empty operands)."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        a = jax.device_put(jnp.ones((B, M, 0), jnp.float16), NamedSharding(mm, P(None, "x")))
        b = jax.device_put(jnp.ones((0, N), jnp.float16), NamedSharding(mm, P(None, "y")))
        bias = jax.device_put(_random(jax.random.key(64), (N,)), NamedSharding(mm, P("y")))
        ours = jax.jit(jax_hopper.matmul)(a, b)
        ref = jax.jit(jnp.matmul)(a, b)
        assert jax.typeof(ours) == jax.typeof(ref) and not np.asarray(ours).any()
        ours = jax.jit(lambda a, b, c: jax_hopper.dense(a, b, c, activation="gelu_tanh"))(a, b, bias)
        ref = jax.jit(lambda a, b, c: jax.nn.gelu(a @ b + c))(a, b, bias)
        assert jax.typeof(ours) == jax.typeof(ref)
        assert relative_error(ours, ref.astype(jnp.float32)) < 1e-2


MLP_PATTERNS = {  # name: (x spec, w1 spec, w2 spec) for x [B, M, K], w1 [K, N], w2 [N, K]
    "data_parallel": (P("x", None, None), P(), P()),
    "sequence_sharded": (P(None, "x", None), P(), P()),
    "tensor_parallel": (P(None, "x", None), P(None, "y"), P("y", None)),  # Megatron: F split
}


@pytest.mark.parametrize("saved", [False, True], ids=["z1", "saved_act'"])
@pytest.mark.parametrize("policy", ["auto", "kernel"])
@pytest.mark.parametrize("pattern", MLP_PATTERNS)
def test_mlp_gradients_under_sharding(pattern, policy, saved):
    """jax_hopper.mlp's custom VJP under Auto mesh axes: each product partitions like a
    plain one; the backward form and the derivative form, with no partitioning rules,
    lower to XLA's (so policy "kernel" runs them only where the program stays on one
    device); `saved`: the forward saves act'(z1)."""
    from layer_cases import ARGNUMS, assert_as_accurate_as_jnp, block_operands, loss, ours, plain_block

    from jax_hopper import _dispatch

    mm = mesh()
    x_s, w1_s, w2_s = MLP_PATTERNS[pattern]
    operands = block_operands((B, M), K, N, jnp.float16, seed=60)
    specs = (x_s, w1_s, P(w1_s[1]) if len(w1_s) > 1 else P(), w2_s, P())
    placed = [jax.device_put(v, NamedSharding(mm, s)) for v, s in zip(operands, specs)]
    with jax_hopper.dispatch(policy), _dispatch.saved_derivative({"gelu_tanh"} if saved else ()):
        mine = jax.jit(jax.grad(loss(ours("gelu_tanh")), argnums=ARGNUMS))(*placed)
    with full_f32():
        exact = jax.grad(loss(plain_block("gelu_tanh")), argnums=ARGNUMS)(*[v.astype(jnp.float32) for v in operands])
    # jnp's block under the same sharding: partial sums over sharded contractions are
    # rounded to 16 bits before the all-reduce there too.
    jnp_own = jax.jit(jax.grad(loss(plain_block("gelu_tanh")), argnums=ARGNUMS))(*placed)
    for name, g, j, e in zip(("x", "w1", "b1", "w2", "b2"), mine, jnp_own, exact):
        assert_as_accurate_as_jnp(f"d{name}", g, j, e)


@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_explicit_mesh_mlp_gradients_follow_jnp(policy):
    """Explicit mesh axes: the result and gradient types are jnp's block's."""
    from layer_cases import ARGNUMS, block_operands, loss, ours, plain_block

    mm = mesh(AxisType.Explicit)
    operands = block_operands((B, M), K, N, jnp.float16, seed=61)
    with use_mesh(mm):
        placed = [jax.device_put(v, NamedSharding(mm, s))
                  for v, s in zip(operands, (P(None, "x"), P(), P(), P(), P()))]
        with jax_hopper.dispatch(policy):
            mine = jax.jit(jax.grad(loss(ours("silu")), argnums=ARGNUMS))(*placed)
        ref = jax.jit(jax.grad(loss(plain_block("silu")), argnums=ARGNUMS))(*placed)
    for g, r in zip(mine, ref):
        assert jax.typeof(g) == jax.typeof(r), (jax.typeof(g), jax.typeof(r))
        assert relative_error(g, r.astype(jnp.float32)) < 2e-2


@pytest.mark.parametrize("policy", ["auto", "kernel"])
@pytest.mark.parametrize("pattern", MLP_PATTERNS)
def test_mlp_forward_mode_under_sharding(pattern, policy):
    """jax.jvp through jax_hopper.mlp under Auto mesh axes (its tangent map's products
    partition like plain ones), as accurate as jnp's block's jvp under the same sharding."""
    from layer_cases import assert_as_accurate_as_jnp, block_operands, ours, plain_block

    mm = mesh()
    x_s, w1_s, w2_s = MLP_PATTERNS[pattern]
    specs = (x_s, w1_s, P(w1_s[1]) if len(w1_s) > 1 else P(), w2_s, P())
    operands = block_operands((B, M), K, N, jnp.float16, seed=62)
    tangents = block_operands((B, M), K, N, jnp.float16, seed=63)
    placed, placed_t = ([jax.device_put(v, NamedSharding(mm, s)) for v, s in zip(vs, specs)]
                        for vs in (operands, tangents))

    def tangent(block, p, t):
        return jax.jit(lambda p, t: jax.jvp(block, p, t)[1])(tuple(p), tuple(t))

    with jax_hopper.dispatch(policy):
        mine = tangent(ours("silu"), placed, placed_t)
    jnp_own = tangent(plain_block("silu"), placed, placed_t)
    with full_f32():
        exact = jax.jvp(plain_block("silu"), *[tuple(v.astype(jnp.float32) for v in vs)
                                               for vs in (operands, tangents)])[1]
    assert_as_accurate_as_jnp("tangent", mine, jnp_own, exact)


@pytest.mark.parametrize("policy", ["kernel", "xla"])
def test_mlp_forward_mode_inside_shard_map(policy):
    """jvp inside shard_map with x split and the weights replicated: the tangent varies
    over x's axis like the value (its type is the value's)."""
    from layer_cases import assert_as_accurate_as_jnp

    mm = mesh()
    keys = jax.random.split(jax.random.key(64), 10)
    x, dx = _random(keys[0], (M, K)), _random(keys[1], (M, K))
    w1, w2, dw1, dw2 = (_random(k, s) / 8 for k, s in zip(keys[2:6], ((K, N), (N, K), (K, N), (N, K))))
    b1, b2, db1, db2 = (_random(k, s) for k, s in zip(keys[6:], ((N,), (K,), (N,), (K,))))

    def jvp_in_shard_map(block):
        def f(p, t):
            spec = (P("x", None), P(), P(), P(), P())
            return jax.shard_map(lambda p, t: jax.jvp(block, p, t), mesh=mm, in_specs=(spec, spec),
                                 out_specs=(P("x", None), P("x", None)))(p, t)
        return jax.jit(f)((x, w1, b1, w2, b2), (dx, dw1, db1, dw2, db2))

    def plain(x, w1, b1, w2, b2):
        return jax.nn.gelu(x @ w1 + b1, approximate=True) @ w2 + b2 + x

    with jax_hopper.dispatch(policy):
        mine = jvp_in_shard_map(lambda *a: jax_hopper.mlp(*a, activation="gelu_tanh", residual=a[0]))
    jnp_own = jvp_in_shard_map(plain)
    with full_f32():
        exact = jax.jvp(plain, *[tuple(v.astype(jnp.float32) for v in vs)
                                 for vs in ((x, w1, b1, w2, b2), (dx, dw1, db1, dw2, db2))])
    for what, m, j, e in zip(("value", "tangent"), mine, jnp_own, exact):
        assert m.shape == e.shape
        assert_as_accurate_as_jnp(what, m, j, e)


@pytest.mark.parametrize("policy", ["auto", "kernel"])
def test_explicit_mesh_mlp_forward_mode_follows_jnp(policy):
    """Explicit mesh axes: the jvp's value and tangent have jnp's block's types."""
    from layer_cases import block_operands, ours, plain_block

    mm = mesh(AxisType.Explicit)
    operands = block_operands((B, M), K, N, jnp.float16, seed=65)
    tangents = block_operands((B, M), K, N, jnp.float16, seed=66)
    with use_mesh(mm):
        placed, placed_t = (tuple(jax.device_put(v, NamedSharding(mm, s))
                                  for v, s in zip(vs, (P(None, "x"), P(), P(), P(), P())))
                            for vs in (operands, tangents))
        with jax_hopper.dispatch(policy):
            mine = jax.jit(lambda p, t: jax.jvp(ours("silu"), p, t))(placed, placed_t)
        ref = jax.jit(lambda p, t: jax.jvp(plain_block("silu"), p, t))(placed, placed_t)
    for m, r in zip(mine, ref):
        assert jax.typeof(m) == jax.typeof(r), (jax.typeof(m), jax.typeof(r))
        assert relative_error(m, r.astype(jnp.float32)) < 2e-2


@pytest.mark.parametrize("specs", [
    (P("x"), P(), P(), P(), P(), P()),  # a replicated residual next to an M-sharded x
    (P("x"), P(), P(), P(), P(), P(None, "y")),
    (P("x"), P(), P(), P(None, "y"), P("y"), P("x")),  # b2 split like w2's columns
], ids=["residual_replicated", "residual_columns", "b2_columns"])
def test_explicit_mesh_mlp_cotangents_take_their_operands_types(specs):
    """Under explicit mesh axes each cotangent has its operand's type (jax requires it):
    the residual's is dy and b2's a sum of dy, both of y's sharding, resharded to the
    operand's (jax refused the gradient with a type error before)."""
    from layer_cases import block_operands

    mm = mesh(AxisType.Explicit)
    x, w1, b1, w2, b2 = block_operands((M,), K, N, jnp.float16, seed=67)
    r = _random(jax.random.key(68), (M, K))

    def loss(block):
        return lambda *a: 0.5 * jnp.sum(block(*a).astype(jnp.float32) ** 2)

    def ours(x, w1, b1, w2, b2, r):
        return jax_hopper.mlp(x, w1, b1, w2, b2, activation="silu", residual=r)

    def theirs(x, w1, b1, w2, b2, r):
        return jax.nn.silu(x @ w1 + b1) @ w2 + b2 + r

    with use_mesh(mm):
        placed = [jax.device_put(v, NamedSharding(mm, s)) for v, s in zip((x, w1, b1, w2, b2, r), specs)]
        for policy in ("auto", "kernel"):
            with jax_hopper.dispatch(policy):
                mine = jax.jit(jax.grad(loss(ours), argnums=range(6)))(*placed)
            ref = jax.jit(jax.grad(loss(theirs), argnums=range(6)))(*placed)
            for g, want, v in zip(mine, ref, placed):
                assert jax.typeof(g) == jax.typeof(want) == jax.typeof(v), (jax.typeof(g), jax.typeof(want))
                assert relative_error(g, want.astype(jnp.float32)) < 2e-2


def test_explicit_matrix_against_a_batch_sharded_stack_on_its_k_axis():
    """matmul(a [M, K@x], b [B@x, K, N]): a broadcast to b's batch takes the batch's
    sharding, and gives up x on its K (jnp.matmul gathers that K). It asked for x twice
    (P('x', None, 'x'): DuplicateSpecError)."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        a = jax.device_put(_random(jax.random.key(50), (M, K)), NamedSharding(mm, P(None, "x")))
        b = jax.device_put(_random(jax.random.key(51), (B * MESH_SHAPE[0], K, N)), NamedSharding(mm, P("x")))
        ours, theirs = jax.jit(jax_hopper.matmul)(a, b), jax.jit(jnp.matmul)(a, b)
        assert ours.sharding.spec == theirs.sharding.spec
        assert relative_error(ours, theirs.astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("a_shape, a_spec, b_shape, b_spec, dn", [
    # a merged K and a unit N in one reshape: [8@x, 16, 16] -> (8, 256, 1)
    ((8, 16, 16), P("x"), (8, 16, 16), P("x"), (((1, 2), (1, 2)), ((0,), (0,)))),
    # the result's split of a sharded M with a unit N: [8, 1024@x, 1] -> (8, 16, 64)
    ((8, 16, 64, 24), P(None, "x"), (8, 24), P(), (((3,), (1,)), ((0,), (0,)))),
    # free and contracting dims transposed, then both merged: [32@x, 8, 8, 8] -> (256, 64)
    ((32, 8, 8, 8), P("x"), (8, 8, 16), P(), (((1, 2), (0, 1)), ((), ()))),
], ids=["merged-K-unit-N", "split-M-unit-N", "two-groups"])
def test_explicit_folds_that_jax_refuses_are_jaxs(a_shape, a_spec, b_shape, b_spec, dn):
    """Under explicit axes jax types each reshape of a sharded operand, and jax 0.10
    refuses some that change two groups of dims at once: there these products are
    computed by jax (they raised ShardingTypeError, found by a fuzz of sharded products);
    jax 0.11 takes those reshapes, and our kernel's plan runs."""
    mm = mesh(AxisType.Explicit)
    with use_mesh(mm):
        a = jax.device_put(_random(jax.random.key(52), a_shape), NamedSharding(mm, a_spec))
        b = jax.device_put(_random(jax.random.key(53), b_shape), NamedSharding(mm, b_spec))
        with jax_hopper.dispatch("kernel"):
            ours = jax.jit(lambda x, y: jax_hopper.dot_general(x, y, dn))(a, b)
            grads = jax.jit(jax.grad(lambda x, y: jnp.sum(jax_hopper.dot_general(x, y, dn).astype(jnp.float32)),
                                     argnums=(0, 1)))(a, b)
        theirs = jax.jit(lambda x, y: lax.dot_general(x, y, dn))(a, b)
    assert ours.sharding.spec == theirs.sharding.spec and ours.shape == theirs.shape
    assert relative_error(ours, theirs.astype(jnp.float32)) < 1e-2
    assert [g.shape for g in grads] == [a.shape, b.shape]


@pytest.mark.parametrize("policy", ["xla", "auto"])
def test_a_broadcast_matmul_left_to_xla_is_jnps_program(policy):
    """matmul(a [M, K], b [B, K, N]) that the dispatcher leaves to XLA is jnp.matmul's own
    program: with K sharded on b alone jnp's gathers K; the broadcast form (a copied to
    [B, M, K], a batched dot) was partitioned into 16-bit partial products summed by an
    all-reduce, twice jnp's error in bf16 (found by tests/fuzz.py)."""
    mm = mesh()
    ka, kb = jax.random.split(jax.random.key(202))
    a = _random(ka, (M, 2 * K), jnp.bfloat16)
    b = jax.device_put(_random(kb, (2, 2 * K, N), jnp.bfloat16), NamedSharding(mm, P(None, "x", None)))

    def ours_fn(x, y):
        with jax_hopper.dispatch(policy):
            return jax_hopper.matmul(x, y)

    ours, ref = jax.jit(ours_fn)(a, b), jax.jit(jnp.matmul)(a, b)
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))
    assert ours.sharding.is_equivalent_to(ref.sharding, ours.ndim), (ours.sharding, ref.sharding)
    text = jax.jit(ours_fn).lower(a, b).compile().as_text()
    ref_text = jax.jit(jnp.matmul).lower(a, b).compile().as_text()
    assert _collectives(text) == _collectives(ref_text)

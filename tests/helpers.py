"""Helpers shared by the test modules (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def hopper_devices():
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return []
    return [d for d in devices if str(getattr(d, "compute_capability", "")).startswith("9")]


def weak(x, dtype):
    """x as a weakly typed array of `dtype` (what jax's internals make of Python scalars;
    there is no public constructor for a weak non-scalar array of a chosen type)."""
    import pytest

    convert = getattr(getattr(jax._src.lax, "lax", None), "_convert_element_type", None)
    if convert is None:
        pytest.skip("this jax has no internal weak-type conversion to build a weak array")
    return convert(x, jnp.dtype(dtype), weak_type=True)


def seed_normal(key, shape, dtype, k):
    """Standard normal scaled by K^-1/4 (the seed's data): C has unit variance."""
    return (jax.random.normal(key, shape, jnp.float32) / k**0.25).astype(dtype)


def f32_reference(a, b):
    """C in f32 from the same (rounded) inputs, with true f32 products on the GPU (batched
    operands multiplied entry by entry, as jnp.matmul does)."""
    return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def full_f32():
    """The context for an f32 reference built from jnp code (x @ w on f32 arrays): jax's
    default f32 dot is TF32 on a GPU (10-bit products), as rough as the 16-bit results it
    would check."""
    return jax.default_matmul_precision("highest")


def relative_error(c, ref) -> float:
    """||C - C_ref||_F / ||C_ref||_F, computed in f32 on the device."""
    diff = c.astype(jnp.float32) - ref
    return float(jnp.linalg.norm(diff) / jnp.linalg.norm(ref))


def run_into_poison(fn, out_shape, dtype, *args):
    """Runs jit(fn)(*args) with its output buffer pre-filled with NaN.

    The NaN buffer is donated to a jit whose only output has the same type, so XLA
    aliases it to the output: any element the kernel fails to write stays NaN. Returns
    (output, whether the output really is the poisoned buffer).
    """
    (out,), aliased = run_into_poisons(lambda *xs: (fn(*xs),), [out_shape], dtype, *args)
    return out, aliased


def run_into_poisons(fn, out_shapes, dtype, *args):
    """run_into_poison for fn returning a tuple of outputs, one NaN buffer each; returns
    (outputs, whether every output really is its poisoned buffer)."""
    poisons = [jnp.full(shape, jnp.nan, dtype) for shape in out_shapes]
    ptrs = [p.unsafe_buffer_pointer() for p in poisons]
    count = len(poisons)
    # keep_unused: otherwise jit prunes the unused poison arguments and nothing is aliased.
    outs = jax.jit(lambda *ps_xs: fn(*ps_xs[count:]), donate_argnums=tuple(range(count)),
                   keep_unused=True)(*poisons, *args)
    jax.block_until_ready(outs)
    return outs, [o.unsafe_buffer_pointer() for o in outs] == ptrs


# One unit in the last place, relative, of each output type: two correct results that
# round (nearly) the same f32 sum can differ by this much.
ULP = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}
F32_UNIT_ROUNDOFF = 2.0**-24


def assert_same_product(out, expected, lhs, rhs, dimension_numbers):
    """`out` is a correctly rounded f32-accumulated dot_general, as good as `expected`.

    Per element, out may differ from the f32 reference by one ulp of the output type
    plus the worst-case f32 summation error (K * u * sum|a||b|), or by as much as
    `expected` (jax's own result) does: XLA rewrites some degenerate products (a vector
    dot product, say) into reductions that round more than that. Anything beyond both
    is a wrong element, not rounding.
    """
    import numpy as np
    from jax import lax

    assert out.shape == expected.shape and out.dtype == expected.dtype, (out.shape, out.dtype, expected.shape,
                                                                        expected.dtype)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = lax.dot_general(f32(lhs), f32(rhs), dimension_numbers, precision=lax.Precision.HIGHEST)
    abs_sum = lax.dot_general(jnp.abs(f32(lhs)), jnp.abs(f32(rhs)), dimension_numbers,
                              precision=lax.Precision.HIGHEST)
    (contract, _), _ = dimension_numbers
    k = 1
    for d in contract:
        k *= lhs.shape[d]
    o, e, r = (np.asarray(f32(x), np.float64) for x in (out, expected, ref))
    bound = ULP[jnp.dtype(out.dtype).name] * np.abs(r) + k * F32_UNIT_ROUNDOFF * np.asarray(abs_sum, np.float64)
    assert not np.isnan(o).any()
    bad = np.abs(o - r) > np.maximum(bound, np.abs(e - r))
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements are off by more than rounding; worst excess " \
                          f"{np.max(np.abs(o - r) - np.maximum(bound, np.abs(e - r))):.3e}"


def use_mesh(mesh):
    """The mesh context (jax.sharding.use_mesh before jax 0.11's jax.set_mesh)."""
    return jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh)


def cuda_text(fn, *args):
    """StableHLO of jit(fn) lowered for CUDA (works on a machine without a GPU)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def decided(problem, policy=None, **op):
    """(path, rule) the dispatcher decides for `problem` with these op fields (_problem.Problem)."""
    import dataclasses

    from jax_hopper import _dispatch

    decision = _dispatch.decide(dataclasses.replace(problem, **op), policy)
    return decision.path, decision.rule


def kernel_ids():
    """{kind name: the FFI `kernel` attribute value} (jax_hopper._kernels)."""
    from jax_hopper import _kernels

    return {kind.name: kind.id for kind in _kernels.KINDS}


# The fused activations, and each as an f32 reference (jax.nn's definitions).
ACTIVATIONS = [None, "relu", "gelu_tanh", "gelu_exact", "silu"]
F32_ACT = {
    None: lambda z: z,
    "relu": jax.nn.relu,
    "gelu_tanh": lambda z: jax.nn.gelu(z, approximate=True),
    "gelu_exact": lambda z: jax.nn.gelu(z, approximate=False),
    "silu": lambda z: z * jax.nn.sigmoid(z),
}


def require_compiled(kind, dtype=None, stages=None):
    """Skips unless this build compiled the kind (at these stages, for this dtype):
    ablations and experiments build only with -DJAX_HOPPER_EXPERIMENTAL_KERNELS=ON."""
    import pytest

    from jax_hopper import _ffi, _kernels

    names = {"float16": "f16", "bfloat16": "bf16"}
    dtype_name = None if dtype is None else names[jnp.dtype(dtype).name]
    if not any(name == kind and (dtype_name is None or inst.dtype == dtype_name) and
               (stages is None or inst.stages == stages) for name, inst in _ffi.compiled_instances()):
        experimental = all(i.experimental for i in _kernels.KIND_BY_NAME[kind].instances
                           if (dtype_name is None or i.dtype == dtype_name) and (stages is None or i.stages == stages))
        why = " (experimental: build with -DJAX_HOPPER_EXPERIMENTAL_KERNELS=ON)" if experimental else ""
        pytest.skip(f"{kind} {dtype_name or ''} {stages or ''} is not compiled in this build{why}")


def slow(value, id=None):
    """A parameter whose case runs in the slow tier only (`pytest -m slow`)."""
    import pytest

    return pytest.param(value, id=id, marks=pytest.mark.slow)

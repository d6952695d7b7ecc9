"""What every primitive's lowering needs to be partitioned as jnp's would be.

A custom call is opaque to XLA's partitioner: left alone, a sharded product would be
gathered onto every device. Each primitive therefore lowers to one of:
  - its local computation, where the program runs on one device (or in a shard_map body
    manual over every axis that spans devices);
  - on Auto mesh axes, a custom_partitioning call whose callbacks (the primitive's own
    partitioning rules) split it;
  - on Explicit mesh axes, whose operand types name their shardings, a shard_map planned
    while lowering (custom_partitioning's body would be traced under the explicit mesh,
    carrying sharding annotations XLA cannot run after partitioning);
  - XLA's own computation, which XLA partitions itself, inside a shard_map body manual
    over only some axes (XLA does not consult custom_partitioning there) and in programs
    exported with jax.export (custom_partitioning's callbacks cannot be serialized).
Also here: the explicit-axes typing helpers the derivative rules need.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.interpreters import mlir
from jax.sharding import AxisType, NamedSharding, PartitionSpec


# ---- mesh axes and specs --------------------------------------------------------------
def axes(spec, ndim):
    """A PartitionSpec as one tuple of mesh-axis names per dimension."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries]


def spec_of(sharding, ndim):
    spec = getattr(sharding, "spec", None)
    return axes(PartitionSpec() if spec is None else spec, ndim)


def pspec(dims):
    return PartitionSpec(*[None if not d else (d[0] if len(d) == 1 else d) for d in dims])


def on_mesh(sharding, mesh):
    """An operand's sharding, or replicated on `mesh` where it names no mesh axes."""
    spec = getattr(sharding, "spec", None)
    if spec is None or not getattr(getattr(sharding, "mesh", None), "axis_names", ()):
        return NamedSharding(mesh, PartitionSpec())
    return sharding


def divides(sharding, mesh_axes, size) -> bool:
    mesh_shape = getattr(getattr(sharding, "mesh", None), "shape", None)
    if not mesh_axes or mesh_shape is None:
        return True
    return size % math.prod(mesh_shape[a] for a in mesh_axes) == 0


def is_explicit(sharding) -> bool:
    """Whether a type's sharding names explicit mesh axes (then it is part of the type)."""
    mesh = getattr(sharding, "mesh", None)
    return hasattr(sharding, "spec") and any("Explicit" in str(t) for t in getattr(mesh, "axis_types", ()))


def padded_spec(sharding, ndim) -> tuple:
    """A sharding's spec with one entry per dimension (trailing ones unsharded)."""
    return tuple(sharding.spec) + (None,) * (ndim - len(tuple(sharding.spec)))


def explicit_mesh(*avals):
    """The mesh of the first aval typed with explicit mesh axes; None if there is none."""
    for aval in avals:
        sharding = getattr(aval, "sharding", None)
        if is_explicit(sharding):
            return sharding.mesh
    return None


def explicit_spec(aval) -> tuple:
    """An aval's spec per dimension under explicit axes; all None for one without them."""
    sharding = getattr(aval, "sharding", None)
    return padded_spec(sharding, aval.ndim) if is_explicit(sharding) else (None,) * aval.ndim


def value_spec(x):
    """x's spec per dimension where explicit mesh axes put it in its type, else None."""
    try:
        sharding = getattr(jax.typeof(x), "sharding", None)
    except (AttributeError, TypeError):
        return None
    return padded_spec(sharding, np.ndim(x)) if is_explicit(sharding) else None


def merge_drops_explicit_sharding(aval, first: int, last: int) -> bool:
    """Whether merging dims first..last of `aval` into one would drop a sharding on
    explicit mesh axes (one of them past `first` is sharded: jax refuses that reshape)."""
    return any(explicit_spec(aval)[first + 1:last + 1])


# ---- explicit typing of derivatives -----------------------------------------------------
def aval(x):
    """x's type; an operand being differentiated is an UndefinedPrimal with an aval."""
    return x.aval if hasattr(x, "aval") else jax.typeof(x)


def sharding_of(x):
    """The sharding in x's type. A type with no mesh (an array made before entering the
    mesh context) counts as replicated over the current mesh, as in jax's dot rule."""
    a = aval(x)
    sharding = getattr(a, "sharding", None)
    if getattr(getattr(sharding, "mesh", None), "empty", False):
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:
            return NamedSharding(mesh, PartitionSpec(*[None] * a.ndim))
    return sharding


def explicitly_typed(x) -> bool:
    """Whether x's own type names explicit mesh axes."""
    return is_explicit(getattr(aval(x), "sharding", None))


def in_type_of(y, like):
    """y resharded to `like`'s sharding where explicit mesh axes put it in the type (a
    cotangent must have its primal's type)."""
    want = None if like is None else sharding_of(like)
    have = getattr(jax.typeof(y), "sharding", None)
    if not (is_explicit(want) and hasattr(have, "spec")):
        return y
    return y if padded_spec(want, y.ndim) == padded_spec(have, y.ndim) else jax.sharding.reshard(y, want)


# ---- lowering contexts ------------------------------------------------------------------
def _free_axes(axis_context):
    """The mesh axes a shard_map body leaves to the compiler that span devices."""
    mesh = axis_context.mesh
    manual = set(getattr(axis_context, "manual_axes", ()))
    return [name for name in mesh.axis_names if name not in manual and mesh.shape[name] > 1]


def spans_devices(ctx) -> bool:
    """Whether XLA will partition this program over several devices."""
    axis_context = getattr(ctx.module_context, "axis_context", None)
    devices = getattr(axis_context, "device_assignment", None)
    if devices is not None:
        return len(devices) > 1
    if getattr(axis_context, "mesh", None) is not None:
        return bool(_free_axes(axis_context))
    return False


def _for_export(ctx) -> bool:
    return bool(getattr(getattr(ctx.module_context, "lowering_parameters", None), "for_export", False))


def _partly_manual(ctx) -> bool:
    """Inside a shard_map manual over some mesh axes, with others left to the compiler."""
    axis_context = getattr(ctx.module_context, "axis_context", None)
    return bool(getattr(axis_context, "manual_axes", ())) and getattr(axis_context, "mesh", None) is not None


def _explicit_operands(ctx) -> bool:
    """The product's operands (the first two) typed with explicit mesh axes, outside any
    shard_map. A layer's bias or residual alone does not count (an absent one is an empty
    stand-in that jnp.zeros types with the current mesh)."""
    shardings = [getattr(a, "sharding", None) for a in ctx.avals_in[:2]]
    return any(is_explicit(s) and AxisType.Manual not in s.mesh.axis_types for s in shardings)


def lowering(local_impl, partitioned_impl, explicit_impl, xla_impl, multiple_results=False):
    """The lowering rule choosing among the four forms in the module docstring."""
    lower = lambda f: mlir.lower_fun(f, multiple_results=multiple_results)  # noqa: E731
    direct, sharded, explicit, by_xla = (lower(f) for f in (local_impl, partitioned_impl, explicit_impl, xla_impl))

    def rule(ctx, *args, **params):
        if not spans_devices(ctx):
            return direct(ctx, *args, **params)
        if _explicit_operands(ctx):
            return explicit(ctx, *args, **params)
        return (by_xla if _partly_manual(ctx) or _for_export(ctx) else sharded)(ctx, *args, **params)

    return rule


def local_only_lowering(local_impl, xla_impl, multiple_results=False):
    """local_impl on one device, xla_impl (which XLA partitions) wherever the program
    spans several: for a primitive with no partitioning rules of its own."""
    direct = mlir.lower_fun(local_impl, multiple_results=multiple_results)
    by_xla = mlir.lower_fun(xla_impl, multiple_results=multiple_results)

    def rule(ctx, *args, **params):
        return (by_xla if spans_devices(ctx) else direct)(ctx, *args, **params)

    return rule


def without_context_mesh(per_device):
    """A partition callback's per-device body, traced with no mesh in context:
    custom_partitioning traces it under whatever mesh the caller set, and under an
    explicit one its jnp ops carry sharding annotations XLA cannot run after partitioning."""
    empty = jax.sharding.AbstractMesh((), ())

    def body(*args):
        with jax.sharding.use_abstract_mesh(empty):
            return per_device(*args)

    return body


def shard_mapped(per_device, arg_shardings, out_sharding, result_sharding, *args):
    """Explicit mesh axes: each device's computation in a shard_map over the planned
    shardings (operands resharded to them), the result resharded to the type the
    primitive declared."""
    args = [jax.sharding.reshard(x, s) for x, s in zip(args, arg_shardings)]
    out = jax.shard_map(per_device, mesh=out_sharding.mesh, in_specs=tuple(s.spec for s in arg_shardings),
                        out_specs=out_sharding.spec, check_vma=False)(*args)
    return jax.sharding.reshard(out, result_sharding)

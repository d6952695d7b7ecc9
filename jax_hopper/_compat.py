"""The one place that touches jax internals or APIs that moved between jax releases.

Supported: jax 0.10 and 0.11. Everything else in the package uses jax's public API.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax._src.dispatch as _jax_dispatch
from jax._src import config as _jax_config


def eager_impl(primitive):
    """A primitive's impl rule for eager calls: jax's own, which compiles the primitive
    alone (one executable per params, cached), also under jax.disable_jit."""
    return functools.partial(_jax_dispatch.apply_primitive, primitive)


def require_devices_at_lowering(primitive) -> None:
    """custom_partitioning needs the device assignment while lowering; jax (0.11) lowers
    multi-device programs without one unless a primitive in the jaxpr asks for it. Ours
    bind custom_partitioning inside their lowering rules, so they ask (as jax's cuDNN
    primitives do)."""
    registry = getattr(_jax_dispatch, "prim_requires_devices_during_lowering", None)
    if registry is not None:
        registry.add(primitive)


def _option(define: Callable, name: str, *args, **kwargs):
    """jax's configuration option `name`, defined once per process (a module reload finds
    the one made before), in jax's trace context and jit key: a function traced under one
    value is traced again under another. jax defines options through a private module only."""
    state = _jax_config.config_states.get(name)
    if state is None:
        state = define(name, *args, **kwargs, include_in_jit_key=True, include_in_trace_context=True)
    return state


def enum_option(name: str, values, default: str, help: str):
    return _option(_jax_config.enum_state, name, list(values), default=default, help=help)


def object_option(name: str, default, help: str):
    return _option(_jax_config.string_or_object_state, name, default=default, help=help)


def varying_axes(x) -> frozenset:
    """The shard_map manual axes x varies over (`aval.vma`, later `aval.mat.varying`);
    empty outside shard_map. x may be a value being transposed (an UndefinedPrimal)."""
    try:
        aval = x.aval if hasattr(x, "aval") else jax.typeof(x)
    except (AttributeError, TypeError):
        return frozenset()
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def match_varying_axes(*xs):
    """Inside shard_map, makes all operands vary over the union of their manual axes, as
    jax does for its own binary primitives (a replicated weight times a sharded input)."""
    axes = [varying_axes(x) for x in xs]
    union = frozenset().union(*axes)
    if all(a == union for a in axes):
        return xs

    def vary(x, missing):
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, tuple(sorted(missing)), to="varying")
        return jax.lax.pvary(x, tuple(sorted(missing)))

    return tuple(vary(x, union - a) for x, a in zip(xs, axes))


def trace_context():
    """The configuration a trace depends on (jax's jit key: the config options in it, the
    mesh in context, the axis environment), hashable; None where jax has no such value
    (then nothing is cached on it)."""
    context = getattr(_jax_config, "trace_context", None)
    return None if context is None else context()

"""Which path computes an eligible problem: our kernel, or XLA's own dot.

One entry point, `decide(problem) -> Decision(path, rule, kind)`, over the rule table in
_rules.py, made at trace time from static shapes. The policy picks how the table is used:

  "auto"    follow the table (the default);
  "kernel"  our kernel wherever it applies (tests, benchmarks, experiments);
  "xla"     never our kernel.

``jax_hopper.set_dispatch(policy)`` sets it for the process (``JAX_HOPPER_DISPATCH``
gives the starting value); ``with jax_hopper.dispatch(policy):`` for a scope. It is a jax
configuration option (``jax_hopper_dispatch``) in jax's trace context and jit key, as
``jax_default_matmul_precision`` is: a function traced under one policy is traced again
under another. Each product of a derivative is decided when the derivative is traced,
under the policy then in effect (wrap ``jax.grad``, not only the forward, to force it).

A kernel pick becomes XLA's dot where the kernel cannot run: a dimension past its int32
limits (rule "beyond-kernel-limits", every policy), or no kernel here (not built, or a
GPU that is not a Hopper: rule "kernel-unavailable", with one warning; the table was
measured on the H200).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax

from jax_hopper import _compat, _ffi, _rules
from jax_hopper._problem import Problem

POLICIES = ("auto", "kernel", "xla")
_ENV = "JAX_HOPPER_DISPATCH"
BEYOND_KERNEL_LIMITS = "beyond-kernel-limits"
KERNEL_UNAVAILABLE = "kernel-unavailable"


def _checked(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"dispatch policy must be one of {POLICIES}, got {policy!r}")
    return policy


_checked(os.environ.get(_ENV, "auto"))  # our error message first; jax then reads the variable itself
_policy = _compat.enum_option(
    _ENV.lower(), POLICIES, "auto",
    "jax_hopper's dispatch policy: auto (the measured rules), kernel (ours wherever it applies), xla (never)")


def current_policy() -> str:
    return _policy.value


def set_dispatch(policy: str) -> None:
    """Sets the dispatch policy ("auto", "kernel" or "xla") for the whole process (as
    ``jax.config.update("jax_hopper_dispatch", policy)`` does)."""
    jax.config.update(_ENV.lower(), _checked(policy))


@contextlib.contextmanager
def dispatch(policy: str):
    """``with jax_hopper.dispatch("kernel"): ...`` -- the policy for this scope only."""
    with _policy(_checked(policy)):
        yield


@dataclasses.dataclass(frozen=True)
class Decision:
    path: str  # "kernel" or "xla"
    rule: str
    kind: str | None  # the kernel kind on the kernel path

    @property
    def by_rules(self) -> bool:
        """Whether the table made it (policy "auto"), not a policy that forces a path:
        then a product's shards, or its vmapped form, are decided again for their shapes."""
        return not self.rule.startswith("policy=")


def decide(problem: Problem, policy: str | None = None) -> Decision:
    """The path, the rule that chose it and the kernel kind for `problem` under `policy`
    (default: the current one)."""
    policy = current_policy() if policy is None else policy
    for rule in _rules.RULES:
        if problem.op in rule.ops and policy in rule.policies and rule.when(problem):
            break
    else:
        raise AssertionError(f"no rule speaks for {problem}")
    if rule.path != "kernel":
        return Decision("xla", rule.name, None)
    if not problem.fits_kernel:
        return Decision("xla", BEYOND_KERNEL_LIMITS, None)
    if not rule.unavailable_ok:
        reason = _ffi.kernel_unavailable_reason()
        if reason is not None:
            _ffi.warn_no_kernel_once(reason)
            return Decision("xla", KERNEL_UNAVAILABLE, None)
    return Decision("kernel", rule.name, rule.kind(problem))


# ---- the saved-derivative form -------------------------------------------------------
# jax_hopper.mlp's forward (and a differentiated dense without a residual) may save
# act'(z1), written by the derivative kind next to act(z1), so the backward pass
# multiplies instead of recomputing act' from z1. By default for these activations,
# where the derivative kind runs; the override (benchmark and tests) forces the form for
# the activations it names, on either path. A jax option too, in the trace key.
SAVED_DERIVATIVE_ACTIVATIONS: frozenset = frozenset({"gelu_exact", "gelu_tanh", "silu"})
_saved_derivative_override = _compat.object_option(
    "jax_hopper_saved_derivative", None,
    "jax_hopper's saved-derivative override (benchmark and tests): None, or the activations that save act'")


def may_save_derivative(activation: str | None) -> bool:
    """Whether saves_derivative can be true for this activation (so whether asking about
    the derivative kind is worth it)."""
    chosen = _saved_derivative_override.value
    chosen = SAVED_DERIVATIVE_ACTIVATIONS if chosen is None else chosen
    return activation is not None and activation in chosen


def saves_derivative(activation: str | None, derivative_kind_runs: bool) -> bool:
    """Whether the forward saves act'(z1) for this activation; `derivative_kind_runs`:
    whether decide() sent the layer's dense_derivative problem to the kernel."""
    if activation is None:
        return False
    if _saved_derivative_override.value is not None:
        return activation in _saved_derivative_override.value
    return activation in SAVED_DERIVATIVE_ACTIVATIONS and derivative_kind_runs


@contextlib.contextmanager
def saved_derivative(activations):
    """Scoped override of the saved-derivative choice: exactly the named activations save
    act'(z1), on either path. For the benchmark and tests."""
    with _saved_derivative_override(frozenset(activations)):
        yield

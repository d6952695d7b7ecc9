"""Differential fuzz on a Hopper GPU: random products, layers and gradients through every
path, each against its f32 reference, element by element, until a time budget runs out.

The test suite checks chosen shapes; this draws fresh ones (tile edges, odd sizes, tiny and
few-thousand dimensions, batches, layouts, dtypes) for:
  kind    each compiled kernel kind by name (primitives.gemm.gemm), in the layouts, dtypes and
          output types it is compiled for, output poisoned with NaN first;
  dot     the public dot_general with random dimension numbers (batch, free and contracting
          dims in any order, several of each) under policies "kernel" and "auto";
  matmul  the public matmul (1-D operands, leading dims broadcast as jnp.matmul's) and
          dot (jnp.dot's N-D semantics);
  vjp     both cotangents of a product under policy "kernel" (the backward products in
          the other layouts), for a fresh 16-bit cotangent;
  dense   jax_hopper.dense with a random activation, bias, residual and leading dims;
  mlp     jax_hopper.mlp's value and its derivatives in all or some operands: reverse mode
          for a fresh cotangent (the backward and derivative forms under "kernel"), or
          forward mode for fresh tangents;
  transforms dot_general, dense or mlp under one or two levels of vmap (random in_axes,
          some operands unmapped, random out_axes) or lax.scan, jax.checkpoint or not: its
          value, reverse, forward or forward-over-reverse derivatives (batching, scan and
          derivative rules);
  sharded one of dot, matmul, vjp, dense, mlp, transforms with every operand placed on a
          mesh of all devices (Auto axes, a random spec each; two or more devices, e.g.
          --cpu-devices 8 on a CPU): the same bounds; results laid out otherwise than jnp's are reported;
  explicit dot_general, matmul/dot, dense or mlp's gradients on Explicit mesh axes (random
          specs): both refuse or neither, the same result types, values within the bounds.

Bounds (why they hold, not tuned): a product rounded once may differ from the f32 reference
by one ulp of its type (the subnormal spacing near zero) plus the worst-case f32 summation
error K u sum|a||b| (u = 2^-24), as tests/helpers.assert_same_product has it; the
f16-accumulating kind is held to test_f16_accumulation's model (twice an f16 unit roundoff
per 16-deep accumulator update, of the exact partial sums). A layer or gradient rounds
intermediates as jnp's own does, so its largest elementwise error may be at most twice
jnp's own largest error against the same f32 reference, plus one ulp of the largest element
(and, for layers, the summation term and the activation's own approximation, at most an ulp
of |z|), and its normwise error at most 1.5x jnp's plus ULP / sqrt(size) (the suite's
rule, with room for one element an ulp from jnp's on tiny results). Since jnp's own error
is a sample of the rounding noise, and on a few elements a lucky one, every layer's or
gradient's element may instead be off by 10 standard deviations of its 16-bit rounding
noise, u times its terms' quadrature (NOISE_SIGMAS, from the block's squared model, without
relu's flips), at most a tenth of the result's scale. Where jax's own result is wrong
(off by a tenth of the scale and beyond its noise), the case is reported ("jaxw") and
jax's error is no yardstick. References and checks run on copies gathered onto one
device, out of XLA's partitioner. A wrong tile, row or column, a stale or unwritten element
is off by the data's own scale, far outside the product bounds; the layer and gradient
rules are relative to jnp's accuracy where that is larger, so they are weaker where jnp's
block is itself inaccurate (relu after a bf16 z rounded twice).

    python3 tests/fuzz.py --seconds 300 --seed 0 --json fuzz.json

Prints each case as it ends and every failure with what reproduces it (seed, families, case
number: the same script, since a change to a family's draws renumbers its cases); exits 1
if any case failed. Off a Hopper GPU it runs the same cases through the fallback (a check
of the harness and of our ops' planning and partitioning, not of the kernel).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback
from typing import NamedTuple


def _cpu_devices_flag(argv) -> int | None:
    for i, arg in enumerate(argv):
        if arg == "--cpu-devices" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--cpu-devices="):
            return int(arg.split("=", 1)[1])
    return None


# CPU devices must be asked for before jax starts its backends (importing jax_hopper does).
if __name__ == "__main__" and _cpu_devices_flag(sys.argv):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_cpu_devices_flag(sys.argv)}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from f16_model import ABS_FLOOR, BOUND_SLACK, F16_UNIT_ROUNDOFF_ANY_ROUNDING, emulate_steps  # noqa: E402
from helpers import ACTIVATIONS, F32_ACT, F32_UNIT_ROUNDOFF, ULP, run_into_poison, use_mesh  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_hopper  # noqa: E402
from jax_hopper import _ffi, _kernels  # noqa: E402
from jax_hopper.primitives.gemm import gemm  # noqa: E402

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]  # (transpose_a, transpose_b)
JNP_LAYOUT = [(False, False)]
_LAYOUT_OF = {("K", "MN"): (False, False), ("K", "K"): (False, True), ("MN", "MN"): (True, False),
              ("MN", "K"): (True, True)}
_DTYPE_OF = {"f16": F16, "bf16": BF16}


def compiled_kinds():
    """{kind: (layouts, dtypes)} for the plain kinds this build compiled (jax_hopper._kernels);
    off a machine with the kernel, the default build's."""
    instances = _ffi.compiled_instances() or {(k.name, i) for k in _kernels.KINDS for i in k.instances
                                              if not i.experimental}
    kinds = {}
    for name, inst in sorted(instances, key=lambda x: (x[0], x[1].dtype, x[1].major_a, x[1].major_b)):
        if name not in _kernels.GEMM_KINDS:
            continue
        layouts, dtypes = kinds.setdefault(name, ([], []))
        layout, dtype = _LAYOUT_OF[(inst.major_a, inst.major_b)], _DTYPE_OF[inst.dtype]
        if layout not in layouts:
            layouts.append(layout)
        if dtype not in dtypes:
            dtypes.append(dtype)
    return {name: (layouts, tuple(dtypes)) for name, (layouts, dtypes) in kinds.items()}


KINDS = compiled_kinds()
# Tile edges of the kinds (64/128-row, 128/256-column tiles, 64-deep K tiles) and TMA's
# 8-element row multiple: sizes at, just under and just over them find off-by-ones.
EDGES = (8, 16, 64, 128, 192, 256, 384, 512, 1024, 2048)
MAX_OUTPUT = 2**23  # elements: keeps one case's reference and checks a fraction of a second
MAX_FLOPS = MAX_FLOPS_DEFAULT = 4e11


class Case:
    """One case's random draws; under a mesh (the sharded family) every operand is placed
    with a random partition spec, and results are compared with jnp's shardings too."""

    def __init__(self, rng: np.random.Generator, mesh=None):
        self.rng = rng
        self.mesh = mesh
        self.specs = []  # each operand's spec, for the case's description
        self.sharding_mismatches = []

    def place(self, x):
        if self.mesh is None:
            return x
        free = list(self.mesh.shape.items())
        spec = []
        for dim in x.shape:
            fits = [(name, size) for name, size in free if dim % size == 0]
            if fits and self.rng.random() < 0.4:
                name, size = fits[int(self.rng.integers(len(fits)))]
                free.remove((name, size))
                spec.append(name)
            else:
                spec.append(None)
        self.specs.append(tuple(spec))
        return jax.device_put(x, NamedSharding(self.mesh, P(*spec)))

    def run(self, fn, out_shape, dtype, *args):
        """jit(fn)(*args) into a NaN-poisoned output buffer (unsharded cases; a sharded
        result is not the single-device poison's buffer)."""
        if self.mesh is not None:
            return jax.jit(fn)(*args)
        return run_into_poison(fn, out_shape, dtype, *args)[0]

    def same_sharding(self, name, mine, jnp_own):
        """Under a mesh, `mine` must come out sharded as jnp's own result does."""
        if self.mesh is not None and not mine.sharding.is_equivalent_to(jnp_own.sharding, mine.ndim):
            self.sharding_mismatches.append(f"{name}: {mine.sharding.spec} where jnp's is {jnp_own.sharding.spec}")

    def size(self, hi=4100):
        r = self.rng.random()
        if r < 0.15:
            return int(self.rng.integers(1, 17))
        if r < 0.4:
            base = int(self.rng.choice(EDGES))
            return max(1, base + int(self.rng.choice([-9, -8, -1, 0, 1, 7, 8])))
        if r < 0.8:
            return int(self.rng.integers(1, 700))
        return int(self.rng.integers(700, hi))

    def choice(self, xs):
        return xs[int(self.rng.integers(len(xs)))]

    def dims(self, count, budget_out, budget_k):
        """`count` sizes (M, N, K-like), shrunk until the output and the work fit."""
        while True:
            m, n, k = self.size(), self.size(), self.size()
            if m * n <= budget_out and 2.0 * m * n * k <= budget_k:
                return m, n, k


def normal(c: Case, shape, dtype, k=1):
    """The seed's data: standard normal scaled by K^-1/4 (C has unit variance), drawn on
    the host (jax.random would compile a program for every new shape)."""
    x = c.rng.standard_normal(shape, dtype=np.float32) / np.float32(max(k, 1) ** 0.25)
    return c.place(jnp.asarray(x.astype(dtype)))


def f32(x):
    return x.astype(jnp.float32)


def local(x):
    """x gathered onto one device, out of its mesh's types. Every reference and check runs on
    such copies, away from XLA's partitioner: on 8 CPU devices (jax 0.10.2 and 0.11.2) XLA
    partitioned jax's own reverse-mode dot_general under vmap of lax.scan wrongly (seed 101,
    case 1844), which made the f32 reference computed from the sharded operands wrong too."""
    return None if x is None else jnp.asarray(np.asarray(x))


def reference(x):
    """A reference computation's input: x in f32, on one device (local)."""
    return None if x is None else f32(local(x))


def rounding(dtype, x):
    """One ulp of x in `dtype`, elementwise: relative for normal numbers, the subnormal
    spacing near zero (a sum that cancels to a few 2^-24 rounds to f16's subnormals)."""
    return ULP[jnp.dtype(dtype).name] * jnp.abs(x) + float(jnp.finfo(dtype).smallest_subnormal)


def _excess(out, ref, abs_sum, k, jnp_own=None, unit_roundoff=F32_UNIT_ROUNDOFF):
    """The product bound's excess (traced inside each check's program): one ulp of the
    result type plus K u sum|a||b|, or jnp's own error where that is larger."""
    bound = rounding(out.dtype, ref) + k * unit_roundoff * abs_sum
    if jnp_own is not None:
        bound = jnp.maximum(bound, jnp.abs(f32(jnp_own) - ref))
    return jnp.max(jnp.abs(f32(out) - ref) - bound, initial=0.0)  # NaN if any element is


# Each check is one jitted program per case (eager ops would compile one program each,
# per new shape: most of a case's time).
@functools.partial(jax.jit, static_argnames=("dims", "unit_roundoff"))
def _product_excess(out, lhs, rhs, jnp_own, *, dims, unit_roundoff):
    ref = lax.dot_general(f32(lhs), f32(rhs), dims, precision=lax.Precision.HIGHEST)
    abs_sum = lax.dot_general(jnp.abs(f32(lhs)), jnp.abs(f32(rhs)), dims, precision=lax.Precision.HIGHEST)
    k = math.prod(lhs.shape[d] for d in dims[0][0])
    return _excess(out, ref, abs_sum, k, jnp_own, unit_roundoff)


def product_excess(out, lhs, rhs, dims, unit_roundoff=F32_UNIT_ROUNDOFF, jnp_own=None):
    """The largest amount by which an element of `out` (a dot_general of lhs and rhs) is
    off its f32 reference by more than one ulp of its type plus the summation bound (0 or
    less: within; NaN where an element is NaN). jnp_own: jax's own result of the same
    product, whose error is allowed too (XLA rewrites some degenerate products into
    reductions that round more than the bound)."""
    return float(_product_excess(*map(local, (out, lhs, rhs, jnp_own)), dims=dims, unit_roundoff=unit_roundoff))


# The test suite's normwise rule for layers and gradients (test_dense, test_mlp): at most
# 1.5x jnp's normwise error, plus room for one element an ulp from jnp's at the data's rms
# size, ULP / sqrt(n): nothing on large results, but on a result of a few elements the
# normwise error is one element's, and one rounding the other way is not a wrong answer
# (a bf16 bias gradient of one element came out one ulp from jnp's, which was nearest).
NORMWISE_FACTOR = 1.5


def normwise_allowed(jnp_own_error, out):
    return NORMWISE_FACTOR * jnp_own_error + ULP[jnp.dtype(out.dtype).name] / math.sqrt(max(out.size, 1))


def _relative(x, exact):
    return jnp.linalg.norm((f32(x) - exact).ravel()) / jnp.maximum(jnp.linalg.norm(exact.ravel()), 1e-30)


# ---- rounding noise: where jnp's own error is no yardstick ------------------------------------
# A layer or gradient rounds intermediates (z, h, dh, dz and their tangents) to 16 bits, as
# jnp's own program does. Each rounding moves an element by up to u (the unit roundoff)
# relative, independently, so an output summing terms t_i carries an error of about
# u sqrt(sum t_i^2): the terms' quadrature (not their worst case u sum|t_i|, which would let a
# wrong element through every long sum). The rules relative to jnp's error cover that where
# jnp's error is typical; on a result of a few elements jnp's may be lucky (seed 91, case
# 121: a 2-element bf16 bias gradient, ours 4.7 ulps off where jnp's was 0.7, whose sum of
# 233 terms cancels from sum|t_i| = 70 to 1.1). So an element may also be off by
# NOISE_SIGMAS of these standard deviations, and the normwise error by noise_norm_factor(n)
# of them (NOISE_SIGMAS on a result of one element, down to NOISE_NORM_BASE on large ones).
# The quadrature magnitudes sqrt(sum t_i^2) come from the same derivative program run on the
# block's squared model (squared_block): each operand, cotangent and tangent squared, the
# activation's derivatives squared at the exact pre-activation, and every sum kept: the
# model's outputs are then sum t_i^2 for each output's terms, order by order.
# How many: jnp's own 16-bit mlp programs against the (kink-free) model, 60 random cases
# (reverse, forward, forward-over-reverse): with no activation, exact GELU or SiLU an element
# reached at most 8.6 standard deviations (the per-output maxima's median: 4.4), normwise at
# most 0.83 of noise_norm_factor. Outside the model, where the rule relative to jnp's judges:
# relu's flips (up to 950) and 16-bit tanh-GELU, whose 1 + tanh cancels (38; ours is f32).
NOISE_SIGMAS = 10.0
NOISE_NORM_BASE = 2.5


def noise_norm_factor(n):
    return NOISE_NORM_BASE + (NOISE_SIGMAS - NOISE_NORM_BASE) / math.sqrt(max(n, 1))


def unit_roundoff(dtype):
    return ULP[jnp.dtype(dtype).name] / 2


# The model's derivatives come from stop_gradient, not custom_jvp: under lax.scan, jax's
# forward-over-reverse differentiated a custom_jvp function's body instead of its rule (2 v t
# for _square's tangent: a Hessian-vector product's model came out negative, seed 102 case
# 1158). A value v0 = stop_gradient(v) plus (v - v0), zero but for its derivatives, has
# whatever derivatives one writes.
def _square(v):
    """v^2 whose derivative is 1: the squared model differentiates in the squares."""
    v0 = lax.stop_gradient(v)
    return v0 * v0 + (v - v0)


def _derivative(fn):
    return lambda z: jax.jvp(fn, (z,), (jnp.ones_like(z),))[1]


# How far a pre-activation's error may reach, in its own standard deviations (u times its
# quadrature magnitude): an activation's derivative that jumps there (relu's at 0) may have
# jumped in a correct 16-bit program, whose rounded z has the other sign (jnp's rounds z to
# 16 bits; our fused kinds keep it in f32 and flip almost never). Such a jump moves dz by
# the whole |dh| (or a tangent's whole |t_z|), which is not noise, and near 0 a bf16 z
# flips for about 1% of elements: counted as noise, 10 sigma of it would let a gradient
# 20% off pass. So the allowance for ours counts no jumps (kink-free model; a flipped
# program is judged against jnp's, whose z flips too), and only the question whether jax's
# own result is wrong counts them, at their worst: a sum of `terms` terms can be
# sqrt(terms) times their quadrature (Cauchy-Schwarz).
KINK_REACH = 4.0
KINKED = ("relu",)


MODEL_ORDERS = 4  # derivatives the model carries: forward-over-reverse needs 2


def _activation_term(activation, order, u, terms, zz, z):
    """The squared model of act^(order) at the exact pre-activation z: its square plus, in
    units of u, the square of its change over z's own rounding noise (u sqrt(zz), zz the
    model's squared pre-activation): act^(order+1)(z)^2 zz where smooth; where a derivative
    jumps, the whole jump times `terms` (0: the kink-free model; KINK_REACH says why)."""
    fn = F32_ACT[activation]
    for _ in range(order):
        fn = _derivative(fn)
    reach = KINK_REACH * u * jnp.sqrt(zz)
    change = jnp.maximum(jnp.abs(fn(z + reach) - fn(z)), jnp.abs(fn(z - reach) - fn(z))) / (KINK_REACH * u)
    kinked = activation in KINKED and order >= 1
    return jnp.square(fn(z)) + jnp.square(change) * (terms if kinked else 1)


def _squared_activation(activation, u, terms, zz, z):
    """The squared activation, shaped as zz (which carries the derivatives): the model of
    act^(n) as its n-th derivative in zz, as the Taylor polynomial at zz's value gives them
    (a tangent's model is the next order's times zz's)."""
    zz0, z = lax.stop_gradient(zz), lax.stop_gradient(z)
    step = zz - zz0  # zero, with zz's derivatives
    return sum(_activation_term(activation, n, u, terms, zz0, z) * step**n / math.factorial(n)
               for n in range(MODEL_ORDERS))


def _matmul(x, w):
    return jnp.matmul(x, w, precision="highest")


def squared_layer(x, w, b, activation, u, jumps=False):
    """The squared model of act(x @ w + b) (f32 operands, b may be None). With `jumps`, a
    derivative's jump counts the most terms of what it may multiply: dh = g W2^T (K terms) or
    a tangent t_x w + x t_w + t_b (2 K + 1)."""
    z = lax.stop_gradient(_matmul(x, w) + (0 if b is None else b))
    zz = _matmul(_square(x), _square(w)) + (0 if b is None else _square(b))
    return _squared_activation(activation, u, 2 * x.shape[-1] + 1 if jumps else 0, zz, z)


def squared_block(op, dtype, jumps=False, **params):
    """The squared model of a block (fuzz's dot_general, dense or mlp) computed in 16-bit
    `dtype`, as a function of the block's f32 operands; run its derivatives for cotangents and
    tangents squared. jumps: count the activation derivative's jumps (KINK_REACH)."""
    if op == "dot_general":
        return lambda x, y: lax.dot_general(_square(x), _square(y), params["dims"], precision="highest")
    activation, u = params["activation"], unit_roundoff(dtype)
    if op == "dense":
        def dense(x, w, *rest):
            b = rest[0] if params["bias"] else None
            y = squared_layer(x, w, b, activation, u, jumps)
            return y + _square(rest[-1]) if params["residual"] else y
        return dense

    def mlp(x, w1, b1, w2, b2):
        h = squared_layer(x, w1, b1, activation, u, jumps)
        y = _matmul(h, _square(w2)) + (0 if b2 is None else _square(b2))
        return y + _square(x) if params["residual"] else y
    return mlp


def noise_models(op, dtype, run, *args, **params):
    """(the kink-free noise for ours, the noise that judges jax's own) of a block: each
    output's quadrature magnitudes from run(squared_block, *args), args the reference inputs
    with cotangents and tangents as model_input gives them. The same where no derivative jumps."""
    noise = rounding_noise(run(squared_block(op, dtype, **params), *args))
    if params.get("activation") not in KINKED:
        return noise, noise
    return noise, rounding_noise(run(squared_block(op, dtype, jumps=True, **params), *args))


def rounding_noise(outputs):
    """The squared model's outputs -> each output's quadrature magnitude."""
    return [jnp.sqrt(jnp.maximum(o, 0.0)) for o in outputs]


def model_input(x):
    """A cotangent's or tangent's input to the squared model: x^2 in f32 (None stays None)."""
    return None if x is None else jnp.square(reference(x))


# jax's own result off by more than this fraction of the result's scale, and beyond the
# rounding noise of a correct program (jumps included), is wrong, not rounded (a 16-bit ulp
# is under 1%): reported (the case's tag "jaxw") and no yardstick; ours is then checked
# against f32 and its noise alone. The noise allowance never exceeds it either.
JAX_WRONG_FRACTION = 0.1


class Check(NamedTuple):
    """One output's check: max|mine - exact|, the allowance relative to jnp's error, the
    largest rounding-noise allowance, whether it failed, whether only the noise allowance
    passed it, whether jax's own result was wrong."""

    err: float
    allowed: float
    noise_allowed: float
    bad: bool
    by_noise: bool
    jax_wrong: bool


@jax.jit
def _errors(mine, jnp_own, exact, noise, jax_noise):
    """Per output: Check's fields (as_accurate_as_jnp)."""
    result = []
    for o, j, e, m, jm in zip(mine, jnp_own, exact, noise, jax_noise):
        ulp, u = ULP[jnp.dtype(o.dtype).name], unit_roundoff(o.dtype)
        diff, rel, scale = jnp.abs(f32(o) - e), _relative(o, e), jnp.max(jnp.abs(e), initial=0.0)
        jnp_diff = jnp.abs(f32(j) - e)
        jnp_err, jnp_rel = jnp.max(jnp_diff, initial=0.0), _relative(j, e)
        jax_wrong = jnp_err > JAX_WRONG_FRACTION * scale
        if jm is not None:
            jax_wrong &= jnp.any(jnp_diff > jnp.maximum(ulp * scale, NOISE_SIGMAS * u * jm))
        jnp_err, jnp_rel = (jnp.where(jax_wrong, 0.0, v) for v in (jnp_err, jnp_rel))  # no yardstick
        allowed = 2.0 * jnp_err + ulp * scale
        normwise = normwise_allowed(jnp_rel, o)
        by_jnp = jnp.all(diff <= allowed) & (rel <= normwise)
        if m is None:
            within, noise_allowed = by_jnp, jnp.float32(0.0)
        else:
            floor = jnp.minimum(NOISE_SIGMAS * u * m, JAX_WRONG_FRACTION * scale)
            noise_normwise = jnp.minimum(noise_norm_factor(o.size) * u * jnp.linalg.norm(m.ravel()) /
                                         jnp.maximum(jnp.linalg.norm(e.ravel()), 1e-30), JAX_WRONG_FRACTION)
            within = jnp.all(diff <= jnp.maximum(allowed, floor)) & (rel <= jnp.maximum(normwise, noise_normwise))
            noise_allowed = jnp.max(floor, initial=0.0)
        result.append((jnp.max(diff, initial=0.0), allowed, noise_allowed, jnp.isnan(o).any() | ~within,
                       within & ~by_jnp, jax_wrong))
    return result


def as_accurate_as_jnp(mine, jnp_own, exact, noise=None, jax_noise=None) -> list[Check]:
    """One Check per output. allowed = 2 x jnp's own largest error + one ulp of the largest
    exact element. bad: a NaN, or an element past both `allowed` and NOISE_SIGMAS x its
    rounding noise (`noise`: each output's kink-free quadrature magnitudes from the squared
    model, or None), or a normwise error past both normwise_allowed (1.5 x jnp's, the suite's
    rule, + ULP / sqrt(size)) and noise_norm_factor x the noise's (each noise allowance at
    most JAX_WRONG_FRACTION of the scale). by_noise: within only by the noise allowance.
    Relative to jnp's accuracy where that is larger: where jnp's block is itself inaccurate
    (relu after bf16 z rounded twice, whose sign then flips for whole rows), only that
    strict. jax_wrong: jax's own result off by more than JAX_WRONG_FRACTION of the scale and
    past the noise of `jax_noise` (jumps counted; default `noise`); then it is no yardstick."""
    noise = [None] * len(mine) if noise is None else noise
    jax_noise = noise if jax_noise is None else jax_noise
    # Only the results may lie on a mesh: exact and the noise come from reference() inputs.
    checks = jax.device_get(_errors(list(map(local, mine)), list(map(local, jnp_own)), exact, noise, jax_noise))
    return [Check(float(e), float(a), float(na), bool(b), bool(n), bool(w)) for e, a, na, b, n, w in checks]


def describe(results: list[Check], names=None):
    """as_accurate_as_jnp's checks, one per output (named or not)."""
    names = names or [""] * len(results)
    return "err/allowed: " + ", ".join(
        f"{(name + ' ') if name else ''}{r.err:.2e}/{r.allowed:.2e}"
        f"{' (NaN or past the bounds)' if r.bad else ''}"
        f"{f' (within rounding noise: {r.noise_allowed:.2e})' if r.by_noise else ''}"
        f"{' (JAX OWN WRONG)' if r.jax_wrong else ''}"
        for name, r in zip(names, results))


# ---- families: each returns (description, ok, detail) -------------------------------------------

def fuzz_kind(c: Case):
    kind = c.choice(sorted(KINDS))
    layouts, dtypes = KINDS[kind]
    ta, tb = c.choice(layouts)
    dtype = c.choice(dtypes)
    out_dtype = F32 if kind != "persistent_f16acc" and c.rng.random() < 0.25 else dtype
    batch = () if c.rng.random() < 0.7 else (int(c.rng.integers(1, 5)),)
    bsz = math.prod(batch)
    m, n, k = c.dims(3, MAX_OUTPUT // bsz, MAX_FLOPS / bsz)
    if kind == "small_m" and c.rng.random() < 0.7:
        m = int(c.rng.integers(1, 257))  # its own range: decode-sized M
    a = normal(c, batch + ((k, m) if ta else (m, k)), dtype, k)
    b = normal(c, batch + ((n, k) if tb else (k, n)), dtype, k)
    what = f"kind {kind} {dtype.name}->{out_dtype.name} batch={batch} m,n,k={m},{n},{k} ta={ta} tb={tb}"
    out = c.run(lambda x, y: gemm(x, y, transpose_a=ta, transpose_b=tb, out_dtype=out_dtype, kernel=kind),
                batch + (m, n), out_dtype, a, b)
    nb = len(batch)
    bdims = (tuple(range(nb)), tuple(range(nb)))
    dims = (((nb + (0 if ta else 1),), (nb + (1 if tb else 0),)), bdims)
    if kind == "persistent_f16acc":
        excess = float(_f16_accumulated_excess(out, jnp.swapaxes(a, -1, -2) if ta else a,
                                               jnp.swapaxes(b, -1, -2) if tb else b))
    else:
        excess = product_excess(out, a, b, dims)
    return what, excess <= 0, f"excess {excess:.3e}"


@jax.jit
def _f16_accumulated_excess(out, a, b):
    """The f16-accumulating kind (a [..., M, K], b [..., K, N]) against test_f16_accumulation's
    bound: twice 2^-10 times the sum over its 16-deep steps of |exact partial sum| (one f16
    unit roundoff per accumulator update), which tracks the real error, unlike the worst
    case K 2^-11 sum|a||b| (3.6 at K = 512 on unit-variance results: a zeroed row passed)."""
    ref = jnp.matmul(f32(a), f32(b), precision="highest")
    _, total = emulate_steps(a, b)
    bound = BOUND_SLACK * F16_UNIT_ROUNDOFF_ANY_ROUNDING * total + ABS_FLOOR
    return jnp.max(jnp.abs(f32(out) - ref) - bound, initial=0.0)


def random_dimension_numbers(c: Case, dtype):
    """Operands with nb batch, nc contracting and free dims, each operand's axes shuffled."""
    nb, nc = int(c.rng.integers(0, 3)), int(c.rng.integers(1, 3))
    fl, fr = int(c.rng.integers(0, 3)), int(c.rng.integers(0, 3))
    small = lambda: int(c.rng.choice([1, 2, 3, 4, 5, 7, 8]))  # noqa: E731
    big = c.size
    while True:
        bs = [small() for _ in range(nb)]
        cs = [big() if i == 0 else small() for i in range(nc)]
        ls = [big() if i == 0 else small() for i in range(fl)]
        rs = [big() if i == 0 else small() for i in range(fr)]
        out = math.prod(bs) * math.prod(ls) * math.prod(rs)
        if out <= MAX_OUTPUT and 2.0 * out * math.prod(cs) <= MAX_FLOPS:
            break
    lhs_axes = [("b", i) for i in range(nb)] + [("c", i) for i in range(nc)] + [("f", i) for i in range(fl)]
    rhs_axes = [("b", i) for i in range(nb)] + [("c", i) for i in range(nc)] + [("f", i) for i in range(fr)]
    c.rng.shuffle(lhs_axes)
    c.rng.shuffle(rhs_axes)
    size = {"b": bs, "c": cs}
    lhs_shape = tuple((ls if t == "f" else size[t])[i] for t, i in lhs_axes)
    rhs_shape = tuple((rs if t == "f" else size[t])[i] for t, i in rhs_axes)
    where = lambda axes, t, i: axes.index((t, i))  # noqa: E731
    dims = ((tuple(where(lhs_axes, "c", i) for i in range(nc)), tuple(where(rhs_axes, "c", i) for i in range(nc))),
            (tuple(where(lhs_axes, "b", i) for i in range(nb)), tuple(where(rhs_axes, "b", i) for i in range(nb))))
    return lhs_shape, rhs_shape, dims


def fuzz_dot(c: Case):
    dtype = c.choice([F16, BF16])
    policy = c.choice(["kernel", "auto"])
    preferred = c.choice([None, None, F32])
    lhs_shape, rhs_shape, dims = random_dimension_numbers(c, dtype)
    k = math.prod(lhs_shape[d] for d in dims[0][0])
    a, b = normal(c, lhs_shape, dtype, k), normal(c, rhs_shape, dtype, k)
    out_shape = jax.eval_shape(lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=preferred), a, b)

    def f(x, y):
        with jax_hopper.dispatch(policy):
            return jax_hopper.dot_general(x, y, dims, preferred_element_type=preferred)

    with jax_hopper.dispatch(policy):
        path = jax_hopper.dispatch_path(a, b, dims, preferred_element_type=preferred)
    what = f"dot {policy} {dtype.name} pref={preferred} lhs={lhs_shape} rhs={rhs_shape} dims={dims} path={path}"
    out, ours_refused = attempt(lambda *xs: c.run(f, out_shape.shape, out_shape.dtype, *xs), a, b)
    expected, refused = attempt(jax.jit(lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=preferred)),
                                a, b)
    if ours_refused is not None:  # on XLA's path ours is jax's own program: a refusal of both is jax's
        same = refused is not None and type(refused) is type(ours_refused)
        return what, same, f"{'both raise' if same else 'ours raises'}: {first_line(ours_refused)}"
    if out.shape != out_shape.shape or out.dtype != out_shape.dtype:
        return what, False, f"type {out.shape} {out.dtype}, jnp's {out_shape.shape} {out_shape.dtype}"
    if refused is not None:  # XLA:CPU runs no bf16 x bf16 = f32 dot of some shapes; ours must still be right
        excess = product_excess(out, a, b, dims)
        return what, excess <= 0, f"excess {excess:.3e} (jax's own raised: {first_line(refused)})"
    excess = product_excess(out, a, b, dims, jnp_own=expected)
    c.same_sharding("result", out, expected)
    return what, excess <= 0, f"excess {excess:.3e}"


def fuzz_vjp(c: Case):
    dtype = c.choice([F16, BF16])
    ta, tb = c.choice(LAYOUTS)
    m, n, k = c.dims(3, MAX_OUTPUT, MAX_FLOPS / 3)
    a = normal(c, (k, m) if ta else (m, k), dtype, k)
    b = normal(c, (n, k) if tb else (k, n), dtype, k)
    g = normal(c, (m, n), dtype)
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))

    def f(x, y, g):
        with jax_hopper.dispatch("kernel"):
            return jax.vjp(lambda x, y: jax_hopper.dot_general(x, y, dims), x, y)[1](g)

    da, db = jax.jit(f)(a, b, g)
    what = f"vjp {dtype.name} m,n,k={m},{n},{k} ta={ta} tb={tb}"
    for out, want in ((da, a), (db, b)):
        if out.shape != want.shape or out.dtype != dtype:
            return what, False, f"cotangent type {out.shape} {out.dtype}"
    if c.mesh is not None:
        jnp_da, jnp_db = jax.jit(lambda x, y, g: jax.vjp(lambda x, y: lax.dot_general(x, y, dims), x, y)[1](g))(
            a, b, g)
        c.same_sharding("da", da, jnp_da)
        c.same_sharding("db", db, jnp_db)
    excess = float(_vjp_excess(*map(local, (a, b, g, da, db)), dims=dims))
    return what, excess <= 0, f"excess {excess:.3e}"


@functools.partial(jax.jit, static_argnames="dims")
def _vjp_excess(a, b, g, da, db, *, dims):
    """Each cotangent is a product of g with the other operand (contracting N), as jax's
    transpose rule of dot_general writes it: the product bound with K = N."""
    n = g.shape[1]

    def pullbacks(a, b, g):
        _, pullback = jax.vjp(lambda x, y: lax.dot_general(x, y, dims, precision="highest"), a, b)
        return pullback(g)

    refs = pullbacks(f32(a), f32(b), f32(g))
    abs_sums = pullbacks(jnp.abs(f32(a)), jnp.abs(f32(b)), jnp.abs(f32(g)))
    excess = [jnp.max(jnp.abs(f32(o) - r) - rounding(o.dtype, r) - n * F32_UNIT_ROUNDOFF * s, initial=0.0)
              for o, r, s in zip((da, db), refs, abs_sums)]
    return jnp.maximum(*excess)


def jnp_layer(x, w, b, r, *, activation):
    """The layer as a jnp user writes it."""
    y = F32_ACT[activation](x @ w + (0 if b is None else b))
    return y if r is None else y + r


def layer_reference(x, w, b, r, activation):
    z = jnp.matmul(f32(x), f32(w), precision="highest")
    if b is not None:
        z = z + f32(b)
    y = F32_ACT[activation](z)
    return z, (y if r is None else y + f32(r))


def fuzz_dense(c: Case):
    dtype = c.choice([F16, BF16])
    policy = c.choice(["kernel", "kernel", "auto"])
    activation = c.choice(ACTIVATIONS)
    lead = c.choice([(), (2,), (3, 2)])
    rows = math.prod(lead)
    m, n, k = c.dims(3, MAX_OUTPUT // rows, MAX_FLOPS / rows)
    x_shape = lead + (m, k)
    x, w = normal(c, x_shape, dtype, k), normal(c, (k, n), dtype, k)
    b = normal(c, (n,), dtype) if c.rng.random() < 0.7 else None
    r = normal(c, lead + (m, n), dtype) if c.rng.random() < 0.5 else None
    what = f"dense {policy} {dtype.name} {activation} x={x_shape} n={n} bias={b is not None} residual={r is not None}"

    def f(x, w, b, r):
        with jax_hopper.dispatch(policy):
            return jax_hopper.dense(x, w, b, activation=activation, residual=r)

    out = c.run(f, lead + (m, n), dtype, x, w, b, r)
    jnp_own = jax.jit(jnp_layer, static_argnames="activation")(x, w, b, r, activation=activation)
    c.same_sharding("result", out, jnp_own)
    err, allowed, excess, bad = (float(v) for v in _dense_errors(*map(local, (out, x, w, b, r, jnp_own)),
                                                                 activation=activation))
    return what, excess <= 0 and not bad, f"max err {err:.3e}, allowed {allowed:.3e} + per element; " \
        f"excess {excess:.3e}"


@functools.partial(jax.jit, static_argnames="activation")
def _dense_errors(out, x, w, b, r, jnp_own, *, activation):
    z, ref = layer_reference(x, w, b, r, activation)
    err = jnp.max(jnp.abs(f32(out) - ref), initial=0.0)
    bad = jnp.isnan(out).any() | (_relative(out, ref) > normwise_allowed(_relative(jnp_own, ref), out))
    allowed = 2.0 * jnp.max(jnp.abs(f32(jnp_own) - ref), initial=0.0) + \
        ULP[jnp.dtype(out.dtype).name] * jnp.max(jnp.abs(ref), initial=0.0)
    # The f32 sum's own error (K u sum|x||w|, through an activation of slope at most 1.13),
    # and the activation's approximation in the kernel (an ulp of |z|), per element.
    abs_sum = jnp.matmul(jnp.abs(f32(x)), jnp.abs(f32(w)), precision="highest")
    per_element = 1.13 * x.shape[-1] * F32_UNIT_ROUNDOFF * abs_sum + rounding(out.dtype, z)
    excess = jnp.max(jnp.abs(f32(out) - ref) - per_element - allowed, initial=0.0)
    return err, allowed, excess, bad


def mlp_block(ours, *, activation, residual):
    """jax_hopper.mlp, or the block as a jnp user writes it (residual: x)."""
    def fn(x, w1, b1, w2, b2):
        if ours:
            return jax_hopper.mlp(x, w1, b1, w2, b2, activation=activation, residual=x if residual else None)
        h = F32_ACT[activation](x @ w1 + (0 if b1 is None else b1))
        y = h @ w2 + (0 if b2 is None else b2)
        return y + x if residual else y
    return fn


def fuzz_mlp(c: Case):
    dtype = c.choice([F16, BF16])
    policy = c.choice(["kernel", "kernel", "auto"])
    activation = c.choice(ACTIVATIONS)
    lead = c.choice([(), (2,)])
    rows = math.prod(lead)
    while True:
        m, d, f = c.size(2100), c.size(2100), c.size(4100)
        if rows * m * max(d, f) <= MAX_OUTPUT and 12.0 * rows * m * d * f <= MAX_FLOPS:
            break
    x = normal(c, lead + (m, d), dtype, d)
    w1, w2 = normal(c, (d, f), dtype, d), normal(c, (f, d), dtype, f)
    b1 = normal(c, (f,), dtype) if c.rng.random() < 0.8 else None
    b2 = normal(c, (d,), dtype) if c.rng.random() < 0.8 else None
    residual = c.rng.random() < 0.7
    dy = normal(c, lead + (m, d), dtype)
    present = [i for i, v in enumerate((x, w1, b1, w2, b2)) if v is not None]
    # Derivatives in every operand, or in some (an operand held fixed gets no cotangent:
    # a frozen bias has no column sum computed).
    moving = present if c.rng.random() < 0.5 else sorted(
        int(i) for i in c.rng.choice(present, size=int(c.rng.integers(1, len(present) + 1)), replace=False))
    mode = c.choice(["reverse", "reverse", "forward"])
    tangents = [normal(c, (x, w1, b1, w2, b2)[i].shape, dtype) for i in moving]
    names = ("x", "w1", "b1", "w2", "b2")
    what = f"mlp {mode} {policy} {dtype.name} {activation} x={x.shape} f={f} b1={b1 is not None} " \
           f"b2={b2 is not None} residual={residual} moving={[names[i] for i in moving]}"

    block = functools.partial(mlp_block, activation=activation, residual=residual)

    def derivatives(fn, operands, g, ts):
        """(y, each moving operand's cotangent for dy = g) or (y, y's tangent)."""
        def run(args, g, ts):
            of_moving = lambda *mv: fn(*[mv[moving.index(i)] if i in moving else args[i]  # noqa: E731
                                         for i in range(5)])
            with jax_hopper.dispatch(policy):
                if mode == "forward":
                    return jax.jvp(of_moving, tuple(args[i] for i in moving), tuple(ts))
                y, pullback = jax.vjp(of_moving, *[args[i] for i in moving])
                return (y,) + tuple(pullback(g))
        return jax.jit(run)(operands, g, ts)

    operands = (x, w1, b1, w2, b2)
    mine = derivatives(block(True), operands, dy, tangents)
    jnp_own = derivatives(block(False), operands, dy, tangents)
    exact_operands = tuple(map(reference, operands))
    with jax.default_matmul_precision("highest"):  # not TF32, a GPU's default for f32
        exact = derivatives(block(False), exact_operands, reference(dy), [reference(t) for t in tangents])
    noises = noise_models("mlp", dtype, derivatives, exact_operands, model_input(dy),
                          [model_input(t) for t in tangents], activation=activation, residual=residual)
    names = ["y"] + (["dy (tangent)"] if mode == "forward" else ["d" + names[i] for i in moving])
    for name, o, j, e in zip(names, mine, jnp_own, exact):
        if o.shape != e.shape or o.dtype != dtype:
            return what, False, f"{name}: type {o.shape} {o.dtype}"
        c.same_sharding(name, o, j)
    results = as_accurate_as_jnp(mine, jnp_own, exact, *noises)
    return what, not any(r.bad for r in results), describe(results, names)


def matmul_shapes(c: Case, dtype, op):
    """Operand shapes for jnp.`op` (matmul or dot): vectors, batch dims of either operand,
    some of them 1; (a shape, b shape, jnp's result type, K)."""
    while True:
        m, n, k = c.size(), c.size(), c.size()
        batch = [int(c.rng.choice([1, 2, 3])) for _ in range(int(c.rng.integers(0, 3)))]
        a_batch = [b if c.rng.random() < 0.7 else 1 for b in batch][int(c.rng.integers(0, len(batch) + 1)):]
        b_batch = [b if c.rng.random() < 0.7 else 1 for b in batch][int(c.rng.integers(0, len(batch) + 1)):]
        a_shape = (k,) if c.rng.random() < 0.1 else tuple(a_batch) + (m, k)
        b_shape = (k,) if c.rng.random() < 0.1 else tuple(b_batch) + (k, n)
        out = jax.eval_shape(getattr(jnp, op), jax.ShapeDtypeStruct(a_shape, dtype),
                             jax.ShapeDtypeStruct(b_shape, dtype))
        if math.prod(out.shape) <= MAX_OUTPUT and 2.0 * math.prod(out.shape) * k <= MAX_FLOPS:
            return a_shape, b_shape, out, k


def fuzz_matmul(c: Case):
    """jnp.matmul's semantics (1-D operands, leading dims broadcast against each other),
    or jnp.dot's (b's leading dims are result dims, a's last contracts with b's
    second-to-last)."""
    dtype = c.choice([F16, BF16])
    policy = c.choice(["kernel", "auto"])
    op = c.choice(["matmul", "matmul", "dot"])
    a_shape, b_shape, out, k = matmul_shapes(c, dtype, op)
    a, b = normal(c, a_shape, dtype, k), normal(c, b_shape, dtype, k)

    def f(x, y):
        with jax_hopper.dispatch(policy):
            return getattr(jax_hopper, op)(x, y)

    what = f"{op} {policy} {dtype.name} a={a_shape} b={b_shape}"
    result = c.run(f, out.shape, out.dtype, a, b)
    if result.shape != out.shape or result.dtype != out.dtype:
        return what, False, f"type {result.shape} {result.dtype}, jnp's {out.shape} {out.dtype}"
    # jnp's own product, its own program: inside the check's program XLA may partition it
    # otherwise (a K-split bf16 product's partial sums rounded or not).
    jnp_own = jax.jit(getattr(jnp, op))(a, b)
    c.same_sharding("result", result, jnp_own)
    excess = float(_jnp_product_excess(*map(local, (result, a, b, jnp_own)), op=op))
    return what, excess <= 0, f"excess {excess:.3e}"


@functools.partial(jax.jit, static_argnames="op")
def _jnp_product_excess(out, a, b, jnp_own, *, op):
    """As product_excess for jnp.`op`, with jnp's own error allowed (a vector product XLA
    may reduce, a K-split sharded product's partial sums rounded: more than the bound)."""
    fn = functools.partial(getattr(jnp, op), precision="highest")
    return _excess(out, fn(f32(a), f32(b)), fn(jnp.abs(f32(a)), jnp.abs(f32(b))), a.shape[-1], jnp_own)


def fuzz_transforms(c: Case):
    """dot_general, dense or mlp under a random stack of transforms, one or two levels of
    vmap (each operand mapped at a random axis or not at all, the result at a random axis)
    or lax.scan (mapping axis 0), around jax.checkpoint or not; its value, or with reverse
    mode, forward mode or forward-over-reverse (a Hessian-vector product) on top: our
    batching, scan and derivative rules against the same stack over jax's own op (jnp's
    accuracy bounds ours, as for layers) and, for a plain product's value, the product bound
    itself."""
    op = c.choice(["dot_general", "dot_general", "dense", "mlp"])
    dtype = c.choice([F16, BF16])
    policy = c.choice(["kernel", "kernel", "kernel", "auto"])  # "auto" leaves most small shapes to XLA
    levels = [(c.choice(["vmap", "vmap", "scan"]), int(c.rng.integers(1, 4))) for _ in range(int(c.rng.integers(1, 3)))]
    batch = math.prod(size for _, size in levels)
    remat = c.rng.random() < 0.3
    mode = str(c.rng.choice(["value", "reverse", "forward", "second"], p=[0.4, 0.25, 0.2, 0.15]))
    cost = {"value": 1, "reverse": 3, "forward": 2, "second": 6}[mode]
    if op == "dot_general":
        while True:
            shapes = random_dimension_numbers(c, dtype)
            out = jax.eval_shape(lambda x, y: lax.dot_general(x, y, shapes[2]),
                                 *(jax.ShapeDtypeStruct(s, dtype) for s in shapes[:2]))
            k = math.prod(shapes[0][d] for d in shapes[2][0][0])
            if batch * out.size <= MAX_OUTPUT and 2.0 * batch * out.size * k <= MAX_FLOPS / cost:
                break
        lhs_shape, rhs_shape, dims = shapes
        base = [lhs_shape, rhs_shape]
        scales = [k, k]
        what = f"dot_general lhs={lhs_shape} rhs={rhs_shape} dims={dims}"

        def block(ours, precision=None):
            return lambda x, y: (jax_hopper.dot_general(x, y, dims) if ours else
                                 lax.dot_general(x, y, dims, precision=precision))
        model = {"dims": dims}
    else:
        activation = c.choice(ACTIVATIONS)
        while True:
            m, n, k = c.size(1100), c.size(1100), c.size(2100)
            work = 2.0 * m * n * k * (2 if op == "mlp" else 1) * cost
            if batch * m * max(n, k) <= MAX_OUTPUT and batch * work <= MAX_FLOPS:
                break
        if op == "dense":
            bias, residual = c.rng.random() < 0.7, c.rng.random() < 0.5
            base = [(m, k), (k, n)] + [(n,)] * bias + [(m, n)] * residual
            scales = [k, k] + [1] * (bias + residual)
            what = f"dense {activation} x={(m, k)} n={n} bias={bias} residual={residual}"

            def block(ours, precision=None):
                def fn(x, w, *rest):
                    b = rest[0] if bias else None
                    r = rest[-1] if residual else None
                    if ours:
                        return jax_hopper.dense(x, w, b, activation=activation, residual=r)
                    return jnp_layer(x, w, b, r, activation=activation)
                return fn
            model = {"activation": activation, "bias": bias, "residual": residual}
        else:  # mlp: x [m, k], w1 [k, n], b1, w2 [n, k], b2, residual x or none
            residual = c.rng.random() < 0.7
            base, scales = [(m, k), (k, n), (n,), (n, k), (k,)], [k, k, 1, n, 1]
            what = f"mlp {activation} x={(m, k)} f={n} residual={residual}"

            def block(ours, precision=None):
                return mlp_block(ours, activation=activation, residual=residual)
            model = {"activation": activation, "residual": residual}
    # Each level maps some operands (at least one) at a random axis, inner level first, and
    # puts its result's mapped axis at a random place (scan: axis 0 both). Each level adds
    # one dim to the result.
    base_ndim = jax.eval_shape(block(False), *(jax.ShapeDtypeStruct(s, dtype) for s in base)).ndim
    shapes, stack = [list(s) for s in base], []
    for level, (kind, size) in enumerate(levels):
        mapped = c.rng.random(len(shapes)) < 0.7
        mapped[int(c.rng.integers(len(shapes)))] = True
        axes = [None if not on else 0 if kind == "scan" else int(c.rng.integers(len(s) + 1))
                for on, s in zip(mapped, shapes)]
        for s, ax in zip(shapes, axes):
            if ax is not None:
                s.insert(ax, size)
        out_axis = int(c.rng.integers(0, 8)) % (base_ndim + level + 1)
        stack.append((kind, tuple(axes), 0 if kind == "scan" else out_axis))
    args = [normal(c, tuple(s), dtype, scale) for s, scale in zip(shapes, scales)]

    def stacked(fn):
        fn = jax.checkpoint(fn) if remat else fn
        for kind, axes, out_axis in stack:
            fn = _scanned(fn, axes) if kind == "scan" else jax.vmap(fn, in_axes=axes, out_axes=out_axis)
        return fn

    # A cotangent typed as the result (reverse, second) and tangents typed as the operands
    # (forward, second), drawn after the operands.
    g, ts = None, None
    if mode in ("reverse", "second"):
        g = normal(c, jax.eval_shape(stacked(block(False)), *args).shape, dtype)
    if mode in ("forward", "second"):
        ts = [normal(c, a.shape, dtype) for a in args]

    def run(block, args, g, ts):
        """(value,), (value, its tangent), (value, cotangents...) or, forward over reverse,
        (value, cotangents..., their tangents...): the value always as the derivative
        computes it (a differentiated layer may run other kernels than its value alone)."""
        with jax_hopper.dispatch(policy):
            fn = stacked(block)
            if mode == "value":
                return (fn(*args),)
            if mode == "forward":
                return jax.jvp(fn, tuple(args), tuple(ts))

            def value_and_cotangents(*a):
                y, pullback = jax.vjp(fn, *a)
                return (y,) + tuple(pullback(g))
            if mode == "reverse":
                return value_and_cotangents(*args)
            values, their_tangents = jax.jvp(value_and_cotangents, tuple(args), tuple(ts))
            return tuple(values) + tuple(their_tangents)

    desc = f"transforms {policy} {dtype.name} {what} levels={[(k, n) + s[1:] for (k, n), s in zip(levels, stack)]} " \
           f"remat={remat} mode={mode}"
    mine_fn = jax.jit(lambda a, g, ts: run(block(True), a, g, ts))
    if policy == "kernel" and "jax_hopper" not in str(jax.make_jaxpr(mine_fn)(args, g, ts)):
        return desc, False, "none of our primitives runs under policy kernel"  # a vacuous comparison
    mine = mine_fn(args, g, ts)
    jnp_own = jax.jit(lambda a, g, ts: run(block(False), a, g, ts))(args, g, ts)
    with jax.default_matmul_precision("highest"):
        exact = jax.jit(lambda a, g, ts: run(block(False, "highest"), a, g, ts))(
            [reference(a) for a in args], reference(g), None if ts is None else [reference(t) for t in ts])
    noises = noise_models(op, dtype, lambda block, *inputs: jax.jit(functools.partial(run, block))(*inputs),
                          [reference(a) for a in args], model_input(g),
                          None if ts is None else [model_input(t) for t in ts], **model)
    for i, (o, j) in enumerate(zip(mine, jnp_own)):
        if o.shape != j.shape or o.dtype != j.dtype:
            return desc, False, f"output {i}: type {o.shape} {o.dtype}, jnp's {j.shape} {j.dtype}"
        c.same_sharding(f"output {i}", o, j)
    results = as_accurate_as_jnp(mine, jnp_own, exact, *noises)
    ok = not any(r.bad for r in results)
    detail = describe(results)
    if op == "dot_general" and mode == "value":  # the product bound too, element by element
        with jax.default_matmul_precision("highest"):
            abs_sum = jax.jit(stacked(block(False, "highest")))(*(jnp.abs(reference(a)) for a in args))
        excess = float(jax.jit(_excess, static_argnums=3)(local(mine[0]), exact[0], abs_sum, k, local(jnp_own[0])))
        ok &= excess <= 0
        detail += f"; excess {excess:.3e}"
    return desc, ok, detail


def _scanned(fn, axes):
    """fn mapped over axis 0 of the operands whose axis is 0 by lax.scan (the rest closed over)."""
    def scanned(*args):
        xs = [a for a, ax in zip(args, axes) if ax is not None]

        def body(carry, slices):
            it = iter(slices)
            return carry, fn(*(next(it) if ax is not None else a for a, ax in zip(args, axes)))
        return lax.scan(body, None, xs)[1]
    return scanned


# The ops a sharded case runs (the kind family's named kinds are for one device's product).
SHARDED_FAMILIES = ("dot", "matmul", "vjp", "dense", "mlp", "transforms")


def fuzz_sharded(c: Case):
    """Another family's case with every operand placed on a mesh of all devices (Auto axes,
    a random spec per operand): the same bounds. A result sharded otherwise than jnp's
    (XLA's propagation under conflicting specs; a fold of a sharded minor free dim, which
    XLA gathers) is reported, not a failure, unless --strict-sharding: values decide."""
    if c.mesh is None:
        raise RuntimeError("the sharded family needs a mesh (two or more devices)")
    family = c.choice(SHARDED_FAMILIES)
    what, ok, detail = FAMILIES[family](c)
    if c.sharding_mismatches:
        detail = f"{detail}; SHARDING differs from jnp's: {'; '.join(c.sharding_mismatches)}"
    return f"sharded {what} specs={c.specs}", ok, detail


def attempt(fn, *args):
    try:
        out = fn(*args)
        return (jax.block_until_ready(out) if fn is not jax.eval_shape else out), None
    except Exception as e:  # jax's refusals: type errors, sharding errors, ValueErrors
        return None, e


def first_line(e) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def fuzz_explicit(c: Case):
    """Explicit mesh axes (sharding in types; two or more devices): operands placed with
    random specs, our op and jnp's under the mesh. Both refuse (a contraction over a sharded
    dim without out_sharding, say) or neither; where they compute, the same result types
    (shardings included) and values within the bounds of the other families (checked on
    gathered copies)."""
    if c.mesh is None:
        raise RuntimeError("the explicit family needs a mesh (two or more devices)")
    op = c.choice(["dot_general", "matmul", "dense", "mlp"])
    dtype = c.choice([F16, BF16])
    policy = c.choice(["kernel", "auto"])
    if op == "dot_general":
        lhs_shape, rhs_shape, dims = random_dimension_numbers(c, dtype)
        k = math.prod(lhs_shape[d] for d in dims[0][0])
        args = (normal(c, lhs_shape, dtype, k), normal(c, rhs_shape, dtype, k))
        ours = lambda x, y: jax_hopper.dot_general(x, y, dims)  # noqa: E731
        theirs = lambda x, y: lax.dot_general(x, y, dims)  # noqa: E731
        what = f"dot_general lhs={lhs_shape} rhs={rhs_shape} dims={dims}"

        def check(got, want, a, b):
            excess = product_excess(got, a, b, dims, jnp_own=want)
            return excess <= 0, f"excess {excess:.3e}"
    elif op == "matmul":
        name = c.choice(["matmul", "dot"])
        a_shape, b_shape, _, k = matmul_shapes(c, dtype, name)
        args = (normal(c, a_shape, dtype, k), normal(c, b_shape, dtype, k))
        ours, theirs = getattr(jax_hopper, name), getattr(jnp, name)
        what = f"{name} a={a_shape} b={b_shape}"

        def check(got, want, a, b):
            excess = float(_jnp_product_excess(got, a, b, want, op=name))
            return excess <= 0, f"excess {excess:.3e}"
    elif op == "dense":
        activation = c.choice(ACTIVATIONS)
        lead = c.choice([(), (2,)])
        m, n, k = c.dims(3, MAX_OUTPUT // math.prod(lead), MAX_FLOPS / math.prod(lead))
        args = (normal(c, lead + (m, k), dtype, k), normal(c, (k, n), dtype, k),
                normal(c, (n,), dtype) if c.rng.random() < 0.7 else None,
                normal(c, lead + (m, n), dtype) if c.rng.random() < 0.5 else None)
        ours = lambda x, w, b, r: jax_hopper.dense(x, w, b, activation=activation, residual=r)  # noqa: E731
        theirs = functools.partial(jnp_layer, activation=activation)
        what = f"dense {activation} x={lead + (m, k)} n={n} bias={args[2] is not None} residual={args[3] is not None}"

        def check(got, want, x, w, b, r):
            err, allowed, excess, bad = (float(v) for v in _dense_errors(got, x, w, b, r, want,
                                                                         activation=activation))
            return excess <= 0 and not bad, f"max err {err:.3e}, allowed {allowed:.3e} + per element"
    else:
        activation = c.choice(ACTIVATIONS)
        m, d, f = c.size(1100), c.size(1100), c.size(2100)
        while m * max(d, f) > MAX_OUTPUT or 12.0 * m * d * f > MAX_FLOPS:
            m, d, f = c.size(1100), c.size(1100), c.size(2100)
        residual = c.rng.random() < 0.7
        args = (normal(c, (m, d), dtype, d), normal(c, (d, f), dtype, d), normal(c, (f,), dtype),
                normal(c, (f, d), dtype, f), normal(c, (d,), dtype))
        # The cotangent typed as jnp's y (a vjp refuses any other type), where jnp's block
        # computes at all.
        with use_mesh(c.mesh):
            y_type, _ = attempt(jax.eval_shape, mlp_block(False, activation=activation, residual=residual), *args)
        g = normal(c, (m, d), dtype)
        if y_type is not None:
            g = jax.device_put(g, NamedSharding(c.mesh, y_type.sharding.spec))
            c.specs[-1] = tuple(y_type.sharding.spec)
        args += (g,)
        what = f"mlp reverse {activation} x={(m, d)} f={f} residual={residual}"

        def grads(block):
            def fn(x, w1, b1, w2, b2, g):
                y, pullback = jax.vjp(block, x, w1, b1, w2, b2)
                return (y,) + tuple(pullback(g))
            return fn

        ours = grads(mlp_block(True, activation=activation, residual=residual))
        theirs = grads(mlp_block(False, activation=activation, residual=residual))

        def check(got, want, *operands):
            *inputs, g = map(reference, operands)
            with jax.default_matmul_precision("highest"):
                exact = jax.jit(theirs)(*inputs, g)
            noises = noise_models("mlp", got[0].dtype, lambda block, *a: jax.jit(grads(block))(*a), *inputs,
                                  model_input(g), activation=activation, residual=residual)
            results = as_accurate_as_jnp(list(got), list(want), list(exact), *noises)
            return not any(r.bad for r in results), describe(results)

    def ours_under_policy(*xs):
        with jax_hopper.dispatch(policy):
            return ours(*xs)

    what = f"explicit {policy} {dtype.name} {what} specs={c.specs}"
    with use_mesh(c.mesh):
        want, jnp_error = attempt(jax.jit(theirs), *args)
        got, our_error = attempt(jax.jit(ours_under_policy), *args)
    if jnp_error is not None and our_error is not None:
        return what, True, f"both refuse; jnp's {first_line(jnp_error)}"
    if jnp_error is not None:
        return what, False, f"jnp refuses ({first_line(jnp_error)}), ours computes"
    if our_error is not None:
        return what, False, f"ours refuses where jnp computes: {first_line(our_error)}"
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        g_type, w_type = jax.typeof(g), jax.typeof(w)
        if (g_type.shape, g_type.dtype) != (w_type.shape, w_type.dtype) or \
                not g.sharding.is_equivalent_to(w.sharding, g.ndim):
            return what, False, f"output {i}: {g_type} sharded {g.sharding.spec}, jnp's {w_type} {w.sharding.spec}"
    ok, detail = check(*jax.tree.map(local, (got, want)), *(local(a) for a in args))
    return what, ok, detail


FAMILIES = {"kind": fuzz_kind, "dot": fuzz_dot, "matmul": fuzz_matmul, "vjp": fuzz_vjp, "dense": fuzz_dense,
            "mlp": fuzz_mlp, "transforms": fuzz_transforms, "sharded": fuzz_sharded, "explicit": fuzz_explicit}
WEIGHTS = {"kind": 4, "dot": 2, "matmul": 1, "vjp": 1, "dense": 2, "mlp": 2, "transforms": 2, "sharded": 3,
           "explicit": 3}
MESH_FAMILIES = ("sharded", "explicit")


def make_mesh(axis_type=AxisType.Auto):
    """All devices of the default platform as a 1-D mesh, or (n/2, 2) from four on; None
    with fewer than two."""
    devices = jax.devices()
    if len(devices) < 2:
        return None
    shape, names = ((len(devices) // 2, 2), ("x", "y")) if len(devices) >= 4 and len(devices) % 2 == 0 else \
        ((len(devices),), ("x",))
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape), devices=devices)


def main(argv=None) -> int:
    global MAX_FLOPS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="stop starting cases after this long")
    parser.add_argument("--cases", type=int, default=10**9, help="at most this many cases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated of {','.join(FAMILIES)}")
    parser.add_argument("--only", type=int, default=None, help="run only case number ONLY (a failure's repro)")
    parser.add_argument("--json", default=None, help="write every case's result here")
    parser.add_argument("--max-flops", type=float, default=MAX_FLOPS, help="largest case's work (a CPU check: 1e9)")
    parser.add_argument("--strict-sharding", action="store_true",
                        help="a sharded result laid out otherwise than jnp's fails its case")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="CPU devices to make (a mesh for the sharded family off a multi-GPU machine)")
    args = parser.parse_args(argv)
    MAX_FLOPS = args.max_flops
    if args.cpu_devices and jax.default_backend() == "cpu" and len(jax.devices()) < args.cpu_devices:
        parser.error(f"{len(jax.devices())} CPU devices: --cpu-devices works from the command line only "
                     "(before jax starts), or set jax_num_cpu_devices first")
    families = [f for f in args.families.split(",") if f]
    unknown = set(families) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}")
    meshes = {"sharded": make_mesh(AxisType.Auto), "explicit": make_mesh(AxisType.Explicit)}
    for family in MESH_FAMILIES:
        if family in families and meshes[family] is None:
            if args.families != parser.get_default("families"):
                parser.error(f"the {family} family needs two or more devices")
            families.remove(family)
            print(f"one device: no {family} cases", flush=True)
    weights = np.array([WEIGHTS[f] for f in families], float)
    mesh = meshes["sharded"]
    print(f"devices: {jax.devices()}; kernel available: {jax_hopper.kernel_available()}; "
          f"mesh: {None if mesh is None else dict(mesh.shape)}", flush=True)
    results, failures, start = [], 0, time.time()
    for i in range(args.cases):
        if args.only is None and time.time() - start > args.seconds:
            break
        if args.only is not None and i != args.only:
            continue
        # One generator per case: a case reproduces from (seed, number) alone.
        rng = np.random.default_rng([args.seed, i])
        family = families[int(rng.choice(len(families), p=weights / weights.sum()))]
        t0 = time.time()
        try:
            what, ok, detail = FAMILIES[family](Case(rng, meshes.get(family)))
        except Exception as e:  # a refused or crashing case is a finding too
            what, ok, detail = f"{family} (raised)", False, "".join(traceback.format_exception_only(e)).strip()
        differs = "SHARDING differs" in detail
        jax_wrong = "JAX OWN WRONG" in detail
        if differs and args.strict_sharding:
            ok = False
        results.append({"case": i, "family": family, "what": what, "ok": bool(ok), "detail": detail,
                        "sharding_differs": differs, "jax_wrong": jax_wrong, "seconds": round(time.time() - t0, 3)})
        tag = "FAIL" if not ok else "jaxw" if jax_wrong else "shrd" if differs else "ok  "
        print(f"[{i}] {tag} {what}: {detail}", flush=True)
        failures += not ok
        if args.only is not None:
            break
        # Every case compiles programs for shapes no later case has: without this the
        # executables pile up (a CPU run ran out of its 23 GB after 1,243 cases).
        jax.clear_caches()
        if args.json and len(results) % JSON_EVERY == 0:  # what a crash or a kill leaves
            write_json(args, families, failures, results)
    counts = {f: sum(r["family"] == f for r in results) for f in families}
    repro = f"--seed {args.seed} --families {','.join(families)}"
    repro += f" --max-flops {args.max_flops:g}" if args.max_flops != MAX_FLOPS_DEFAULT else ""
    repro += f" --cpu-devices {args.cpu_devices}" if args.cpu_devices else ""
    differs = sum(r["sharding_differs"] for r in results)
    jax_wrong = sum(r["jax_wrong"] for r in results)
    print(f"{len(results)} cases ({counts}) in {time.time() - start:.0f} s, {failures} failed"
          f"{f', {differs} sharded otherwise than jnp' if differs else ''}"
          f"{f', {jax_wrong} where jax own result was wrong' if jax_wrong else ''}; "
          f"reproduce one with {repro} --only N", flush=True)
    if args.json:
        write_json(args, families, failures, results)
    return 1 if failures else 0


JSON_EVERY = 25  # cases


def write_json(args, families, failures, results):
    with open(args.json + ".tmp", "w") as fh:
        json.dump({"seed": args.seed, "families": families, "failures": failures, "cases": results}, fh, indent=1)
    os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    sys.exit(main())

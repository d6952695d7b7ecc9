"""What the benchmark measures: each case is a frozen spec whose `run(runner)` returns
rows, one per variant, jax_hopper side by side with jnp (the baseline of every ratio).

  ProductCase  one product (any layout, batched or not): the dispatcher's path, our kernel
               forced where it picked XLA, the seed's V5 and extra kinds, jnp.dot, torch
  MlpCase      a transformer MLP block: forward, training steps, the backward forms and
               the forward's parts one by one
  DenseCase    one dense layer act(x W + b)
  LmHeadCase   an output layer with f32 logits and cross-entropy: loss and training step
  ChainCase    a jitted chain of dependent products: the host's cost per product
  TpMlpCase    a tensor-parallel MLP block over several devices

`Build` says which kernel instances this installation compiled, so forced kinds are only
asked of kernels that exist.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from bench_protocol import (
    Runner,
    TorchVariant,
    input_set_count,
    make_inputs,
    sustained_mean,
    sustained_ms,
    sustained_rounds,
)

import jax_hopper
from jax_hopper import _ffi, _kernels, _rules
from jax_hopper._dispatch import decide, saved_derivative
from jax_hopper._problem import layer_problem, problem_of
from jax_hopper._reference import (
    ACTIVATION_FNS,
    activation_derivative,
    activation_grad_like_jnp,
    activation_with_derivative,
    row_sum,
)
from jax_hopper.primitives.dense_derivative import fused_dense_with_derivative
from jax_hopper.primitives.dense_grad import fused_activation_grad
from jax_hopper.primitives.gemm import gemm

DTYPES = {"f16": jnp.float16, "bf16": jnp.bfloat16}
# Operand layouts: A stored [M, K] ("n") or [K, M] ("t"); B stored [K, N] ("n") or [N, K] ("t").
LAYOUT_FLAGS = {"nn": (False, False), "nt": (False, True), "tn": (True, False), "tt": (True, True)}
# The shapes users run: squares, LLM training shapes, decode shapes (small M against
# 8192x8192 weights), odd sizes (8191: rows TMA cannot describe).
SWEEP_SHAPES = ("1024,2048,4096,6144,8192,16384,4096x14336x4096,4096x4096x14336,16384x8192x8192,"
                "8192x8192x1024,16x8192x8192,64x8192x8192,128x8192x8192,256x8192x8192,"
                "1000,3000x5000x7000,8191,2047,4095")
BASELINE = "jnp"  # the variant every step's ratio is against ("jnp.dot" for products)
EXPERIMENTAL_OPTION = "-DJAX_HOPPER_EXPERIMENTAL_KERNELS=ON"
NN = ("K", "MN")  # jnp.dot's operand majors: the layout the seed's V5 and most kinds are compiled for


# ---- the compiled kernels -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Build:
    """The kernel instances a forced kind can run: (kind, dtype, major of A, major of B,
    stages). `note` says how they are known where the extension does not list them."""

    instances: frozenset
    note: str | None = None

    @classmethod
    def current(cls, platform: str | None = None) -> Build:
        """This installation's: the extension's list; without one (an extension older
        than compiled_instances(), or none at all), none -- except where no GPU is there,
        where every row times XLA's dot anyway and a default build's instances stand in."""
        try:
            listed = _ffi.compiled_instances()
        except AttributeError:  # an extension built before it listed its instances
            listed, why = frozenset(), "this build's extension does not list its compiled instances"
        else:
            why = None if _ffi.kernel_available() else "no compiled extension"
        if why is None:
            return cls(frozenset((kind, i.dtype, i.major_a, i.major_b, i.stages) for kind, i in listed))
        if platform is not None and platform != "gpu":
            return cls(default_instances(), f"{why}; no GPU, so the rows time XLA's dot: a default build's "
                                            f"kernels stand in for this build's")
        return cls(frozenset(), f"{why}: taken as none compiled")

    def has(self, kind, dtype, stages=None, majors=NN) -> bool:
        stages = _kernels.stages_of(kind) if stages is None else stages
        return (kind, dtype, *majors, stages) in self.instances

    def extra_kinds(self) -> list[str]:
        """The kinds --kernels can time: plain-GEMM kinds with a jnp.dot-layout instance."""
        return sorted(k for k in _kernels.GEMM_KINDS if any(self.has(k, d) for d in DTYPES))

    def v5_stages(self) -> list[int]:
        return sorted({s for kind, _, a, b, s in self.instances if kind == "v5" and (a, b) == NN})

    def missing(self, kind, stages, dtypes) -> str | None:
        """Why `kind` at `stages` (None: its own depth) cannot be timed in jnp.dot's layout
        for any of `dtypes`, or None where it can for one of them."""
        stages = _kernels.stages_of(kind) if stages is None else stages
        if any(self.has(kind, d, stages) for d in dtypes):
            return None
        listed = [i for i in _kernels.KIND_BY_NAME[kind].instances
                  if (i.major_a, i.major_b) == NN and i.stages == stages and i.dtype in dtypes]
        what = f"{kind} at {stages} stages ({', '.join(dtypes)}, NN)"
        if listed and all(i.experimental for i in listed):
            return (f"{what} is experimental, compiled only with the CMake option {EXPERIMENTAL_OPTION} "
                    f"(pip install -C cmake.define.JAX_HOPPER_EXPERIMENTAL_KERNELS=ON .)")
        return f"{what} is not compiled in this build"

    def describe(self) -> dict:
        return {"kinds": self.extra_kinds(), "v5_stages": self.v5_stages(), "note": self.note}


def default_instances() -> frozenset:
    """What a build without the experimental option compiles."""
    return frozenset((k.name, i.dtype, i.major_a, i.major_b, i.stages)
                     for k in _kernels.KINDS for i in k.instances if not i.experimental)


# ---- products -------------------------------------------------------------------------------
def stored_shapes(batch, m, n, k, layout):
    ta, tb = LAYOUT_FLAGS[layout]
    lead = (batch,) if batch else ()
    return lead + ((k, m) if ta else (m, k)), lead + ((n, k) if tb else (k, n))


def dimension_numbers(batch, layout):
    ta, tb = LAYOUT_FLAGS[layout]
    nb = 1 if batch else 0
    contract = ((nb + (0 if ta else 1),), (nb + (1 if tb else 0),))
    return contract, ((0,), (0,)) if batch else ((), ())


def relative_error(c, a, b, dims) -> float:
    ref = jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                              precision=jax.lax.Precision.HIGHEST)
    diff = c.astype(jnp.float32) - ref
    return float(jnp.linalg.norm(diff) / jnp.linalg.norm(ref))


@dataclasses.dataclass(frozen=True)
class ProductCase:
    """One product against jnp.dot (and torch.matmul where importable). `stages`: the
    seed's V5 depths and `kernels`: extra kinds, both timed in jnp.dot's layout only and
    only those given (the caller keeps to what is compiled for this dtype)."""

    batch: int
    m: int
    n: int
    k: int
    layout: str
    dtype: str
    stages: tuple[int, ...] = ()
    kernels: tuple[str, ...] = ()
    torch: bool = True
    mode = "products"

    @property
    def label(self) -> str:
        batch = f"{self.batch}x" if self.batch else ""
        return f"{batch}{self.m}x{self.n}x{self.k} {self.layout.upper()} {self.dtype}"

    def run(self, runner: Runner) -> list[dict]:
        batch, m, n, k, layout = self.batch, self.m, self.n, self.k, self.layout
        dtype = DTYPES[self.dtype]
        a_shape, b_shape = stored_shapes(batch, m, n, k, layout)
        n_sets = input_set_count(a_shape, b_shape, jnp.dtype(dtype).itemsize, runner.protocol)
        sets = make_inputs(a_shape, b_shape, k, dtype, n_sets)
        ta, tb = LAYOUT_FLAGS[layout]
        dims = dimension_numbers(batch, layout)
        # The default call (the dispatcher picks our kernel or XLA's dot) and, where it
        # picked XLA, our kernel forced (the kind the policy "kernel" runs: the small-M
        # kind for decode shapes), so every row shows what the kernel does.
        path, rule = jax_hopper.dispatch_path(*sets[0], dims)
        kind = _rules.kernel_for(problem_of(a_shape, b_shape, dtype, dtype, ta, tb))
        variants = [runner.variant("jax_hopper", functools.partial(jax_hopper.dot_general, dimension_numbers=dims))]
        kinds = {"jax_hopper": kind if path == "kernel" else None}
        if path != "kernel":
            name = "kernel" if kind == _kernels.DEFAULT_KIND else f"kernel {kind}"
            variants.append(runner.variant(name, functools.partial(gemm, transpose_a=ta, transpose_b=tb, kernel=kind)))
            kinds[name] = kind
        if layout == "nn" and not batch:  # the seed's V5 and the extra kinds are compiled for jnp.dot's layout
            for s in self.stages:
                variants.append(runner.variant(f"V5 s={s}", functools.partial(gemm, kernel="v5", stages=s)))
                kinds[f"V5 s={s}"] = "v5"
            for name in self.kernels:
                variants.append(runner.variant(name, functools.partial(gemm, kernel=name)))
                kinds[name] = name
        # The baseline: what jnp.dot / lax.dot_general lowers to (cuBLASLt on the H200).
        variants.append(runner.variant("jnp.dot", functools.partial(jax.lax.dot_general, dimension_numbers=dims)))
        variant_sets = {v.name: sets for v in variants}
        torch = _torch_variant(ta, tb, runner.protocol.torch_burst) if self.torch else None
        if torch is not None:
            variants.append(torch)
            variant_sets[torch.name] = torch.convert(sets)

        errors = {v.name: relative_error(v.fn(*sets[0]), *sets[0], dims) for v in variants if hasattr(v, "fn")}
        timings = runner.time(variants, variant_sets)
        flops = 2.0 * max(batch, 1) * m * n * k
        rows = [{
            "batch": batch, "m": m, "n": n, "k": k, "layout": layout, "dtype": self.dtype, "variant": v.name,
            "clock": v.clock, **timings.fields(v.name, flops, "jnp.dot"),
            "rel_error": errors.get(v.name), "input_sets": n_sets,
            "path": path if v.name == "jax_hopper" else None, "rule": rule if v.name == "jax_hopper" else None,
            "kind": kinds.get(v.name),
        } for v in variants]
        del sets, variant_sets
        return rows


def _torch_variant(ta, tb, burst):
    try:
        import torch
    except ImportError:
        return None
    return TorchVariant(torch, ta, tb, burst) if torch.cuda.is_available() else None


# ---- policies, entered while jit traces --------------------------------------------------------
def _policy(policy, f):
    def run(*args):
        with jax_hopper.dispatch(policy):  # read while jit traces (the derivative included)
            return f(*args)
    return run


def kernel_forced(f):
    return _policy("kernel", f)


def auto(f):
    """What a user gets by default, whatever JAX_HOPPER_DISPATCH this process has."""
    return _policy("auto", f)


def with_saved_derivative(activation, f):
    """f with exactly `activation` (None: no activation) saving act'(z1) on either path."""
    def run(*args):
        with saved_derivative(() if activation is None else {activation}):  # read while jit traces
            return f(*args)
    return run


def _and_row_sum(dz):
    """(dz, db) as jnp's backward pass computes db from its 16-bit dz."""
    return dz, row_sum(dz, dz.dtype)


def _decision(problem):
    d = decide(problem, "auto")
    return d.path, d.rule


def time_steps(runner: Runner, fns, first, params, flops, meta, auto_path=None) -> list[dict]:
    """Rows for variants {name: f(first, params)} of one step, "jnp" the baseline: the
    relative error of each output against jnp's, kernel time and sustained time (and, if
    the protocol asks, each variant's kernels). auto_path: the dispatcher's (path, rule)
    for "jax_hopper auto"."""
    paths = {"jax_hopper": ("kernel", "forced"), "jax_hopper auto": auto_path}
    variants = [runner.variant(name, fn) for name, fn in fns.items()]
    ref = jax.tree.leaves(next(v for v in variants if v.name == BASELINE).fn(first, params))  # jitted, as timed
    errors = {}
    for v in variants:
        out = jax.tree.leaves(v.fn(first, params))
        errors[v.name] = max(float(jnp.linalg.norm(o.astype(jnp.float32) - r.astype(jnp.float32)) /
                                   jnp.linalg.norm(r.astype(jnp.float32))) for o, r in zip(out, ref))
    timings = runner.time(variants, {v.name: [(first, params)] for v in variants})
    breakdown = runner.breakdown(variants, (first, params))
    rows = []
    for v in variants:
        path, rule = paths.get(v.name) or (None, None)
        rows.append({
            **meta, "variant": v.name, "clock": v.clock, **timings.fields(v.name, flops, BASELINE),
            **({"kernels": breakdown[v.name]} if breakdown else {}),
            "rel_error": errors[v.name] if v.name != BASELINE else None, "input_sets": 1,
            "path": path, "rule": rule,
        })
    return rows


# ---- the MLP block ---------------------------------------------------------------------------
MLP_STEPS = ("forward", "train", "train mlp op", "train mlp op with dx", "train mlp op saved act'",
             "train mlp op auto vs z1 kept", "dz1 times saved act'", "dz1 backward form",
             "dz1 and db1 times saved act'", "dz1 and db1 backward form", "dense1 act and act'",
             "dense1 bias+act", "dense2 bias+resid", "x@W1 no epilogue", "h@W2 no epilogue")


@dataclasses.dataclass(frozen=True)
class MlpCase:
    """A transformer MLP block, y = act(x W1 + b1) W2 + b2 + x, as jax_hopper.dense (bias,
    activation and residual fused into the kernel; our kernel forced) and as
    jax_hopper.mlp (the same, plus act' fused into the backward pass's dh product)
    against the same block in plain jnp (XLA fuses what it can into cuBLASLt's
    epilogues). Forward alone, training steps (gradients of all parameters), the
    forward's parts one by one (each dense with its epilogue, each product with no
    epilogue: what the fused epilogue costs on top of the plain kernel) and the backward
    forms alone. `steps`: the names (MLP_STEPS) to run, empty for all."""

    tokens: int
    d_model: int
    d_ff: int
    dtype: str
    activation: str = "gelu_tanh"
    steps: tuple[str, ...] = ()
    mode = "mlp"

    @property
    def label(self) -> str:
        return f"mlp {self.tokens}x{self.d_model}x{self.d_ff} [{self.activation}] {self.dtype}"

    def run(self, runner: Runner) -> list[dict]:
        tokens, d_model, d_ff, activation = self.tokens, self.d_model, self.d_ff, self.activation
        dtype = DTYPES[self.dtype]
        keys = jax.random.split(jax.random.key(0), 5)
        x = jax.random.normal(keys[0], (tokens, d_model), jnp.float32).astype(dtype)
        params = ((jax.random.normal(keys[1], (d_model, d_ff), jnp.float32) / d_model**0.5).astype(dtype),
                  (0.1 * jax.random.normal(keys[2], (d_ff,), jnp.float32)).astype(dtype),
                  (jax.random.normal(keys[3], (d_ff, d_model), jnp.float32) / d_ff**0.5).astype(dtype),
                  (0.1 * jax.random.normal(keys[4], (d_model,), jnp.float32)).astype(dtype))
        steps = mlp_steps(x, params, activation)
        rows = []
        for step in MLP_STEPS:
            if self.steps and step not in self.steps:
                continue
            fns, first, products = steps[step]
            meta = {"batch": 0, "m": tokens, "n": d_ff, "k": d_model, "layout": f"mlp {step} [{activation}]",
                    "dtype": self.dtype}
            rows += time_steps(runner, fns, first, params, 2.0 * tokens * d_model * d_ff * products, meta)
        return rows


def mlp_steps(x, params, activation):
    """{step: ({variant: f(first, params)}, first, products in the step)}. "jax_hopper"
    forces our kernel on every product, the backward ones included (the policy is read
    while jit traces, the derivative too); "jax_hopper auto" is what a user gets by
    default: the dispatcher's choice for each product."""
    act = ACTIVATION_FNS[activation]
    pre = x @ params[0] + params[1]  # the first layer's pre-activation (the backward form's z)
    hidden = act(pre)  # the second dense's input, for its own rows
    saved = activation_derivative(pre, activation)  # act'(z1), as the saved-derivative form keeps it

    def block(x, p):
        h = jax_hopper.dense(x, p[0], p[1], activation=activation)
        return jax_hopper.dense(h, p[2], p[3], residual=x)

    def mlp_op(x, p):
        return jax_hopper.mlp(x, p[0], p[1], p[2], p[3], activation=activation, residual=x)

    def plain(x, p):
        return act(x @ p[0] + p[1]) @ p[2] + p[3] + x

    def train(block, with_dx=False):
        # 0.5 * sum(y^2): dy = y, unit scale (a mean would scale dy by 1/(tokens d_model),
        # below the 16-bit range, and compare underflow with underflow). with_dx: the
        # input's gradient too, as a block inside a network needs (one more product).
        return jax.grad(lambda x, p: 0.5 * jnp.sum(block(x, p).astype(jnp.float32) ** 2),
                        argnums=(0, 1) if with_dx else 1)

    def ours_both(f):
        return {"jax_hopper": kernel_forced(f), "jax_hopper auto": auto(f)}

    def grad_form(act_, bias_grad):  # dz1 (and db1) from (dy, z1 or act'(z1)): ours, then jnp's
        ours = lambda dz, p: fused_activation_grad(dz[0], p[2], dz[1], activation=act_,  # noqa: E731
                                                   bias_grad=bias_grad)
        jnp_dz = lambda dz, p: activation_grad_like_jnp(dz[0], p[2], dz[1], activation=act_)  # noqa: E731
        return {"jax_hopper": ours, "jnp": (lambda dz, p: _and_row_sum(jnp_dz(dz, p))) if bias_grad else jnp_dz}

    dense1 = lambda xh, p: jax_hopper.dense(xh[0], p[0], p[1], activation=activation)  # noqa: E731
    dense2 = lambda xh, p: jax_hopper.dense(xh[1], p[2], p[3], residual=xh[0])  # noqa: E731
    steps = {
        "forward": ({**ours_both(block), "jnp": plain}, x, 2),
        "train": ({**ours_both(train(block)), "jnp": train(plain)}, x, 5),  # + dW2, dh and dW1 (no dx)
        "train mlp op": ({**ours_both(train(mlp_op)), "jnp": train(plain)}, x, 5),
        # A block inside a network: + dx = dz1 W1^T, a sixth product in both.
        "train mlp op with dx": ({**ours_both(train(mlp_op, True)), "jnp": train(plain, True)}, x, 6),
        # The saved-derivative form: the forward saves act'(z1) instead of z1 (the
        # derivative kind where the dispatcher picks it), the backward multiplies.
        "train mlp op saved act'": ({"jax_hopper": with_saved_derivative(activation, kernel_forced(train(mlp_op))),
                                     "jax_hopper auto": with_saved_derivative(activation, auto(train(mlp_op))),
                                     "jnp": train(plain)}, x, 5),
        # The dispatcher's choice of form against z1 kept, interleaved in one process (the
        # A/B of a saved-derivative rule: the two differ only where the rule runs).
        "train mlp op auto vs z1 kept": ({"jax_hopper auto": auto(train(mlp_op)),
                                          "auto, z1 kept": with_saved_derivative(None, auto(train(mlp_op))),
                                          "jnp": train(plain)}, x, 5),
        # The multiply alone: dz1 = (dy W2^T) * act'(z1) with act'(z1) saved (our backward
        # form with no activation; jnp: the product, then a multiply pass). x stands in for
        # dy (same shape, unit scale).
        "dz1 times saved act'": (grad_form(None, False), (x, saved), 1),
        # dz1 = (dy W2^T) * act'(z1): the backward form (one launch) against jnp's product
        # and elementwise pass; z1 is the real one.
        "dz1 backward form": (grad_form(activation, False), (x, pre), 1),
        # The same two with the first layer's bias gradient db1 = sum of dz1's rows: summed
        # in our epilogue (XLA adding the M/64 partial rows), against jnp's product and one
        # pass computing dz1 and db1.
        "dz1 and db1 times saved act'": (grad_form(None, True), (x, saved), 1),
        "dz1 and db1 backward form": (grad_form(activation, True), (x, pre), 1),
        # act(z1) and act'(z1) of z1 = x W1 + b1: the derivative kind (one launch, both from
        # the f32 z1) against jnp's product and one pass computing both.
        "dense1 act and act'": ({"jax_hopper": lambda xh, p: fused_dense_with_derivative(xh[0], p[0], p[1],
                                                                                         activation=activation),
                                 "jnp": lambda xh, p: activation_with_derivative(xh[0] @ p[0] + p[1], activation)},
                                (x, hidden), 1),
        "dense1 bias+act": ({**ours_both(dense1), "jnp": lambda xh, p: act(xh[0] @ p[0] + p[1])}, (x, hidden), 1),
        "dense2 bias+resid": ({"jax_hopper": kernel_forced(dense2),
                               "jnp": lambda xh, p: xh[1] @ p[2] + p[3] + xh[0]}, (x, hidden), 1),
        "x@W1 no epilogue": ({"jax_hopper": kernel_forced(lambda xh, p: jax_hopper.matmul(xh[0], p[0])),
                              "jnp": lambda xh, p: xh[0] @ p[0]}, (x, hidden), 1),
        "h@W2 no epilogue": ({"jax_hopper": kernel_forced(lambda xh, p: jax_hopper.matmul(xh[1], p[2])),
                              "jnp": lambda xh, p: xh[1] @ p[2]}, (x, hidden), 1),
    }
    assert tuple(steps) == MLP_STEPS
    return steps


# ---- one dense layer, the LM head, the chain ---------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DenseCase:
    """One dense layer, act(x W + b), as jax_hopper.dense (our fused kernel forced, and the
    dispatcher's choice) against plain jnp (XLA fuses the bias and what it can of the
    activation into cuBLASLt's epilogue): the evidence for the fused-activation rule."""

    tokens: int
    d_in: int
    d_out: int
    dtype: str
    activation: str | None = "gelu_tanh"
    mode = "dense"

    @property
    def label(self) -> str:
        return f"dense {self.tokens}x{self.d_in}x{self.d_out} [{self.activation or 'linear'}] {self.dtype}"

    def run(self, runner: Runner) -> list[dict]:
        tokens, d_in, d_out, activation = self.tokens, self.d_in, self.d_out, self.activation
        dtype = DTYPES[self.dtype]
        keys = jax.random.split(jax.random.key(1), 3)
        x = jax.random.normal(keys[0], (tokens, d_in), jnp.float32).astype(dtype)
        params = ((jax.random.normal(keys[1], (d_in, d_out), jnp.float32) / d_in**0.5).astype(dtype),
                  (0.1 * jax.random.normal(keys[2], (d_out,), jnp.float32)).astype(dtype))
        act = ACTIVATION_FNS[activation]
        ours = lambda x, p: jax_hopper.dense(x, p[0], p[1], activation=activation)  # noqa: E731
        fns = {"jax_hopper": kernel_forced(ours), "jax_hopper auto": auto(ours),
               "jnp": lambda x, p: act(x @ p[0] + p[1])}  # as a user writes it (jax.nn.gelu etc. on the 16-bit sum)
        meta = {"batch": 0, "m": tokens, "n": d_out, "k": d_in, "layout": f"dense bias+{activation or 'linear'}",
                "dtype": self.dtype}
        problem = layer_problem((tokens, d_in), (d_in, d_out), dtype, op="dense", activation=activation)
        return time_steps(runner, fns, x, params, 2.0 * tokens * d_in * d_out, meta, auto_path=_decision(problem))


@dataclasses.dataclass(frozen=True)
class LmHeadCase:
    """A language model's output layer as mixed-precision models write it: 16-bit hidden
    states h and weights W, f32 logits (preferred_element_type=f32), mean cross-entropy
    against random labels. The loss alone and a training step (gradients of h and W, whose
    cotangent is f32: the backward products take it against a 16-bit operand), through
    jax_hopper.dot (the dispatcher's choice, and our kernel forced) against jnp.dot."""

    tokens: int
    d_model: int
    vocab: int
    dtype: str
    mode = "lm head"

    @property
    def label(self) -> str:
        return f"lm head {self.tokens}x{self.d_model}x{self.vocab} {self.dtype}"

    def run(self, runner: Runner) -> list[dict]:
        tokens, d_model, vocab = self.tokens, self.d_model, self.vocab
        dtype = DTYPES[self.dtype]
        keys = jax.random.split(jax.random.key(3), 3)
        h = jax.random.normal(keys[0], (tokens, d_model), jnp.float32).astype(dtype)
        params = ((jax.random.normal(keys[1], (d_model, vocab), jnp.float32) / d_model**0.5).astype(dtype),
                  jax.random.randint(keys[2], (tokens,), 0, vocab))

        def loss(dot):
            def run(h, p):
                logits = dot(h, p[0], preferred_element_type=jnp.float32)
                picked = jnp.take_along_axis(logits, p[1][:, None], axis=-1)[:, 0]
                return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)
            return run

        def train(dot):  # gradients of h and W (not of the integer labels)
            return lambda h, p: jax.grad(lambda h, w: loss(dot)(h, (w, p[1])), argnums=(0, 1))(h, p[0])

        auto_path = _decision(problem_of((tokens, d_model), (d_model, vocab), dtype, jnp.float32, False, False))
        rows = []
        for step, fn, products in (("forward", loss, 1), ("train", train, 3)):
            fns = {"jax_hopper": kernel_forced(fn(jax_hopper.dot)), "jax_hopper auto": auto(fn(jax_hopper.dot)),
                   "jnp": fn(jnp.dot)}
            meta = {"batch": 0, "m": tokens, "n": vocab, "k": d_model, "layout": f"lm head {step} [f32 logits]",
                    "dtype": self.dtype}
            rows += time_steps(runner, fns, h, params, 2.0 * tokens * d_model * vocab * products, meta,
                               auto_path=auto_path)
        return rows


@dataclasses.dataclass(frozen=True)
class ChainCase:
    """The host side per call: one jitted program of `length` dependent products
    x <- x @ W_i (x [rows, size], W_i [size, size]; rows = size by default; each kernel
    waits for the previous one), ours (kernel
    forced, and the dispatcher's choice) against jnp.dot. Kernel time is the sum of the
    chain's kernels (CUPTI); sustained time is wall time over back-to-back calls, so where
    the kernels are short it shows what each product costs the host (the FFI handler:
    tensor maps, the ticket counter's memset, the launch) -- the part the other modes
    cannot see, because there one Python dispatch per product dominates."""

    size: int
    length: int
    dtype: str
    rows: int | None = None
    mode = "chain"

    @property
    def m(self) -> int:
        return self.size if self.rows is None else self.rows

    @property
    def label(self) -> str:
        shape = f"{self.size}^3" if self.m == self.size else f"{self.m}x{self.size}x{self.size}"
        return f"chain of {self.length} x {shape} {self.dtype}"

    def run(self, runner: Runner) -> list[dict]:
        size, length, m = self.size, self.length, self.m
        dtype = DTYPES[self.dtype]
        keys = jax.random.split(jax.random.key(2), length + 1)
        x = jax.random.normal(keys[0], (m, size), jnp.float32).astype(dtype)
        # Unit-variance weights over sqrt(size) keep x at unit variance down the chain.
        weights = tuple((jax.random.normal(kk, (size, size), jnp.float32) / size**0.5).astype(dtype)
                        for kk in keys[1:])

        def chain(dot):
            def run(x, ws):
                for w in ws:
                    x = dot(x, w)
                return x
            return run

        ours = chain(jax_hopper.matmul)
        fns = {"jax_hopper": kernel_forced(ours), "jax_hopper auto": auto(ours), "jnp": chain(jnp.dot)}
        meta = {"batch": 0, "m": m, "n": size, "k": size, "layout": f"chain of {length}", "dtype": self.dtype}
        problem = problem_of((m, size), (size, size), dtype, dtype, False, False)
        rows = time_steps(runner, fns, x, weights, 2.0 * length * m * size**2, meta, auto_path=_decision(problem))
        for r in rows:  # per product, in microseconds
            r["kernel_us_per_product"] = r["kernel_ms"] * 1e3 / length
            r["sustained_us_per_product"] = r["sustained_ms"] * 1e3 / length
        return rows


# ---- tensor parallel -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TpMlpCase:
    """A tensor-parallel MLP block on `devices` devices: x @ W1 (column parallel: W1 split
    on its output dim), GELU, @ W2 (row parallel: W2 split on its input dim, so XLA adds a
    psum). Ours and jnp.matmul in the same jitted block; and the same block sequence
    parallel (tokens sharded: all-gather before, reduce-scatter after) as
    jax_hopper.collective's rings and as jnp with jax's collectives, each compared with its
    own jnp form. Sustained timing only (wall clock
    of back-to-back dispatches: per-kernel CUPTI time does not cover the collective across
    devices), reported in the kernel-time fields too."""

    tokens: int
    d_model: int
    d_ff: int
    dtype: str
    devices: int = 2
    mode = "tp-mlp"

    @property
    def label(self) -> str:
        return f"tp-mlp {self.tokens}x{self.d_model}x{self.d_ff} x{self.devices} {self.dtype}"

    def run(self, runner: Runner) -> list[dict]:
        from jax.sharding import AxisType, NamedSharding
        from jax.sharding import PartitionSpec as P

        tokens, d_model, d_ff, n_devices = self.tokens, self.d_model, self.d_ff, self.devices
        dtype = DTYPES[self.dtype]
        devices = jax.devices()[:n_devices]
        if len(devices) < n_devices:
            raise SystemExit(f"--tp-mlp needs {n_devices} devices, found {len(devices)}")
        mesh = jax.make_mesh((n_devices,), ("tp",), axis_types=(AxisType.Auto,), devices=devices)
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.device_put(jax.random.normal(keys[0], (tokens, d_model), jnp.float32).astype(dtype),
                           NamedSharding(mesh, P()))
        w1 = jax.device_put((jax.random.normal(keys[1], (d_model, d_ff), jnp.float32) / d_model**0.5).astype(dtype),
                            NamedSharding(mesh, P(None, "tp")))
        w2 = jax.device_put((jax.random.normal(keys[2], (d_ff, d_model), jnp.float32) / d_ff**0.5).astype(dtype),
                            NamedSharding(mesh, P("tp", None)))

        def block(mm):
            return jax.jit(lambda a, b, c: mm(jax.nn.gelu(mm(a, b)), c))

        # Sequence parallel (the tokens sharded too, in a shard_map): jax_hopper.collective's
        # rings, whose transfers run beside the products, against jnp's all_gather, products
        # and psum_scatter, each waiting for its collective.
        def sequence_parallel(body):
            specs = (P("tp", None), P(None, "tp"), P("tp", None))
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp", None)))

        def ring(a, b, c):
            hidden = jax.nn.gelu(jax_hopper.all_gather_matmul(a, b, "tp"))
            return jax_hopper.matmul_reduce_scatter(hidden, c, "tp")

        def gathered(a, b, c):
            hidden = jax.nn.gelu(jnp.matmul(jax.lax.all_gather(a, "tp", tiled=True), b))
            return jax.lax.psum_scatter(jnp.matmul(hidden, c), "tp", scatter_dimension=0, tiled=True)

        # Our kernel on every shard, whatever the table says: the policy entered inside the
        # outer jit's trace (it is in jax's jit key: a call outside it would trace the block
        # again under the default; entered per call, it would add microseconds per call).
        variants = {"jax_hopper": jax.jit(kernel_forced(block(jax_hopper.matmul))), "jnp.dot": block(jnp.matmul),
                    "jax_hopper ring": jax.jit(kernel_forced(sequence_parallel(ring))),
                    "jnp sequence parallel": sequence_parallel(gathered)}
        baseline = {"jax_hopper": "jnp.dot", "jnp.dot": "jnp.dot", "jax_hopper ring": "jnp sequence parallel",
                    "jnp sequence parallel": "jnp sequence parallel"}
        outs = {name: f(x, w1, w2) for name, f in variants.items()}

        def rel_error(name):
            ref = outs[baseline[name]].astype(jnp.float32)
            return float(jnp.linalg.norm(outs[name].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))

        class Loop:  # what sustained_ms dispatches: the block on (x, w1) and the fixed w2
            def __init__(self, f):
                self.dispatch, self.sync = (lambda a, b: f(a, b, w2)), jax.block_until_ready

        p = runner.protocol
        runner.progress.expect(p.sustained_rounds)
        times = sustained_rounds({name: functools.partial(sustained_ms, Loop(f), [(x, w1)], 1.0, p)
                                  for name, f in variants.items()},
                                 rounds=p.sustained_rounds, settle=p.sustained_settle_rounds,
                                 progress=runner.progress.advance)
        avg = sustained_mean(times)
        flops = 2.0 * 2 * tokens * d_model * d_ff
        return [{
            "batch": 0, "m": tokens, "n": d_ff, "k": d_model, "layout": f"tp-mlp x{n_devices}", "dtype": self.dtype,
            "variant": name, "clock": "wall", "kernel_ms": avg[name], "kernel_tflops": flops / avg[name] / 1e9,
            "kernel_ratio_vs_jnp": avg[baseline[name]] / avg[name], "baseline": baseline[name],
            "kernel_spread_ms": [min(times[name]), max(times[name])],
            "sustained_ms": avg[name], "sustained_tflops": flops / avg[name] / 1e9,
            "sustained_ratio_vs_jnp": avg[baseline[name]] / avg[name], "sustained_rounds_ms": times[name],
            "rel_error": rel_error(name), "input_sets": 1,
        } for name in variants]

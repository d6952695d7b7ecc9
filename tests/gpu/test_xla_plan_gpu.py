"""Our calls where XLA plans around them (Hopper only; skipped with a reason elsewhere):
on a side stream beside another of ours on the main stream, and captured into XLA's
command buffers (CUDA graphs). Every workspace (the ticket counter, split K's and
stream-K's partial sums) is a result of the call that XLA plans, so both give bitwise
the results of the plain serial calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_into_poisons, seed_normal
from jax.experimental import compute_on as _compute_on

from jax_hopper import _ffi
from jax_hopper.primitives.gemm import gemm

# The function form of compute_on: compute_on2 in jax 0.10, compute_on from 0.11.
_ON_STREAM = getattr(_compute_on, "compute_on2", _compute_on.compute_on)


def on_stream_1(f):
    return _ON_STREAM(f, compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)

F16 = jnp.float16

# (kind, M, N, K), each using its workspace on an H100 or H200: tiles past one wave take
# tickets; 16 x 1024 x 8192 cuts its 8 tiles into more pieces than a cluster holds, so
# they meet in the workspace; stream-K splits its last, partial wave.
PRODUCTS = {
    "persistent": (4160, 4096, 192),
    "small_m": (16, 1024, 8192),
    "persistent_streamk": (1000, 3000, 4160),
}
PAIRS = [("persistent", "persistent"), ("small_m", "small_m"), ("small_m", "persistent"),
         ("persistent", "small_m"), ("persistent_streamk", "persistent_streamk"),
         ("persistent_streamk", "small_m")]


def _operands(kind, seed):
    m, n, k = PRODUCTS[kind]
    ka, kb = jax.random.split(jax.random.key(seed))
    return seed_normal(ka, (m, k), F16, k), seed_normal(kb, (k, n), F16, k)


def _product(kind):
    return lambda a, b: gemm(a, b, kernel=kind)


def _bits(x):
    return np.asarray(x).view(np.uint16)


@pytest.mark.parametrize("side,main", PAIRS, ids=[f"{s}-on-stream-1+{m}" for s, m in PAIRS])
def test_side_stream_beside_the_main_stream_is_bitwise_serial(hopper, side, main):
    for kind in (side, main):
        if not _ffi.kind_compiled(kind):
            pytest.skip(f"{kind} is not compiled into this build (-DJAX_HOPPER_EXPERIMENTAL_KERNELS=ON)")
    a1, b1 = _operands(side, seed=1)
    a2, b2 = _operands(main, seed=2)
    serial = [jax.jit(_product(side))(a1, b1), jax.jit(_product(main))(a2, b2)]
    on_side = on_stream_1(_product(side))

    def both(a1, b1, a2, b2):
        return on_side(a1, b1), _product(main)(a2, b2)

    hlo = jax.jit(both).lower(a1, b1, a2, b2).compile().as_text()
    assert "_xla_stream_annotation" in hlo and "-start" in hlo, "XLA did not put the call on a side stream"
    assert hlo.count('custom_call_target="jax_hopper_gemm"') == 2
    shapes = [s.shape for s in serial]
    for rep in range(100):
        outs, aliased = run_into_poisons(both, shapes, F16, a1, b1, a2, b2)
        assert aliased, "the poisoned buffers were not the outputs"
        for which, out, ref in zip(("side", "main"), outs, serial):
            np.testing.assert_array_equal(_bits(out), _bits(ref), err_msg=f"repetition {rep}, {which} stream")


# Every kind this build compiled, with the fused forms, in one process per setting. With
# command buffers on (and a graph of one command allowed), XLA must capture every call.
COMMAND_BUFFER_PROGRAM = textwrap.dedent("""
    import hashlib, json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_hopper
    from jax_hopper import _dispatch, _ffi, _kernels
    from jax_hopper.primitives.gemm import gemm

    def normal(key, shape, k):
        return (jax.random.normal(key, shape, jnp.float32) / k**0.25).astype(jnp.float16)

    SHAPES = {"persistent": (4160, 4096, 192), "small_m": (16, 1024, 8192), "persistent_streamk": (1000, 3000, 4160)}
    cases = {}
    for kind in sorted({name for name, _ in _ffi.compiled_instances()} & set(_kernels.GEMM_KINDS)):
        m, n, k = SHAPES.get(kind, (300, 520, 200))
        ka, kb = jax.random.split(jax.random.key(m + n))
        a, b = normal(ka, (m, k), k), normal(kb, (k, n), k)
        cases[kind] = (lambda kind: lambda a, b: gemm(a, b, kernel=kind))(kind), (a, b)
    cases["small_m_clusters"] = cases["small_m"][0], (normal(jax.random.key(3), (16, 4096), 4096),
                                                      normal(jax.random.key(4), (4096, 4096), 4096))
    x, w1, w2 = (normal(jax.random.key(i), s, 512) for i, s in enumerate([(300, 512), (512, 1024), (1024, 512)]))
    b1, b2 = jnp.ones((1024,), jnp.float16), jnp.ones((512,), jnp.float16)

    def block(x, w1, b1, w2, b2):
        return jax_hopper.mlp(x, w1, b1, w2, b2, activation="gelu_tanh", residual=x)

    def block_grads(x, w1, b1, w2, b2):
        return jax.grad(lambda *p: jnp.sum(block(*p).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4))(
            x, w1, b1, w2, b2)

    cases["mlp forward and backward"] = block_grads, (x, w1, b1, w2, b2)
    out = {}
    RUNS = 10
    runs = _ffi._jax_hopper.ffi_handler_runs
    with jax_hopper.dispatch("kernel"), _dispatch.saved_derivative({"gelu_tanh"}):
        for name, (fn, args) in cases.items():
            f = jax.jit(fn)
            result = jax.block_until_ready(f(*args))
            hlo = f.lower(*args).compile().as_text()
            calls = len(re.findall(r'custom_call_target="jax_hopper_', hlo))
            # Ten more runs: without command buffers each runs every handler; a captured
            # call's graph is replayed without its handler (XLA records it again where
            # its buffers moved, which the runs' freed outputs make rare).
            before = runs()
            for _ in range(RUNS):
                again = [np.asarray(x) for x in jax.tree.leaves(f(*args))]
                assert all(np.array_equal(x, np.asarray(y)) for x, y in zip(again, jax.tree.leaves(result))), name
                del again
            digest = hashlib.sha256(b"".join(np.asarray(r).tobytes() for r in jax.tree.leaves(result))).hexdigest()
            out[name] = {"digest": digest, "calls": calls, "handler_runs": runs() - before}
    print(json.dumps(out))
""")

COMMAND_BUFFERS = {"off": "--xla_gpu_enable_command_buffer=",
                   "on": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"}


def _run_program(flags):
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_FLAGS": flags}
    run = subprocess.run([sys.executable, "-c", COMMAND_BUFFER_PROGRAM], capture_output=True, text=True, cwd="/",
                         env=env)
    assert run.returncode == 0, f"XLA_FLAGS={flags}: {run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_command_buffers_capture_every_kind_with_bitwise_equal_results(hopper):
    off, on = (_run_program(COMMAND_BUFFERS[s]) for s in ("off", "on"))
    assert off.keys() == on.keys()
    for name in off:
        assert on[name]["calls"] > 0, f"{name}: no call of ours in the program"
        assert off[name]["handler_runs"] == 10 * off[name]["calls"], f"{name}: {off[name]}"
        # Captured: at least 7 of the 10 runs replayed the graph without running a handler.
        assert on[name]["handler_runs"] <= 3 * on[name]["calls"], f"{name}: not captured: {on[name]}"
        assert on[name]["digest"] == off[name]["digest"], f"{name}: results differ with command buffers on"

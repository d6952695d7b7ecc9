"""GPU tests (Hopper only): the decode kind's two ways of summing split K agree bit for bit.

The small-M kind cuts each tile's K range into P pieces, one CTA each, and sums their f32
partial sums in piece order, either in a cluster of the tile's pieces (each piece adds
its share of the columns from all pieces' shared memory, cuda/gemm/stream_k_fixup.cuh:
SplitKReduce) or, where clusters do not fit, through a global workspace (the last piece
to arrive adds them all). Both add the same numbers in the same order, so at the same P
they must give the same bits; a column block summed from the wrong piece, a piece added
twice or out of order, or a row of the second M tile mixed up would show here in the
last bits, below any tolerance against a reference.

Which path runs and how many pieces depends on the device, so each (path, P) runs in
its own process with the launch's test overrides set (cuda/gemm/launch.cuh, read once
per process): JAX_HOPPER_SPLIT_K_PIECES=P, and JAX_HOPPER_SPLIT_K_CLUSTER=1 (clusters
required: a launch that cannot use them fails instead of quietly taking the other path)
or =0 (always the workspace). The cases have at most 16 tiles, so clusters of up to
8 CTAs fit on any H100/H200.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import f32_reference, relative_error, seed_normal

ERROR_FACTOR = 1.5  # as in test_numerics_gpu: only a different f32 summation order
PIECES = [2, 3, 5, 8]  # 8: the most a portable cluster holds; 3 and 5 split the columns unevenly

# (batch dims, M, N, K, input dtype, output dtype). Rows 65-96 live in a second M tile;
# N = 1031 leaves rows that neither TMA nor pair stores can write (element by element);
# K = 3000 ends in a partial K tile and splits unevenly.
CASES = [
    ((), 16, 1000, 4096, "float16", "float32"),
    ((), 16, 1000, 4096, "float16", "float16"),
    ((), 80, 1000, 4096, "float16", "float32"),
    ((), 96, 1000, 3000, "bfloat16", "bfloat16"),
    ((), 5, 1031, 4096, "float16", "float16"),
    ((2,), 16, 520, 4096, "float16", "float32"),
    ((3,), 70, 200, 2048, "bfloat16", "float32"),
]


def _name(case) -> str:
    batch, m, n, k, dtype, out_dtype = case
    return "x".join(map(str, (*batch, m, n, k))) + f"_{dtype}_{out_dtype}"


def _inputs(case):
    batch, m, n, k, dtype, _ = case
    ka, kb = jax.random.split(jax.random.key(m * 7 + n + k))
    return seed_normal(ka, (*batch, m, k), jnp.dtype(dtype), k), seed_normal(kb, (*batch, k, n), jnp.dtype(dtype), k)


# Runs every case with the small-M kind into NaN-poisoned outputs and saves them.
_PROGRAM = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path[:0] = sys.argv[1].split(":")
    import jax, jax.numpy as jnp
    from helpers import run_into_poison
    import test_split_k_gpu as t
    from jax_hopper.primitives.gemm import gemm
    outs = {}
    for case in map(tuple, json.loads(sys.argv[2])):
        case = (tuple(case[0]),) + case[1:]
        batch, m, n, k, _, out_dtype = case
        a, b = t._inputs(case)
        f = lambda x, y: gemm(x, y, kernel="small_m", out_dtype=jnp.dtype(out_dtype))
        out, aliased = run_into_poison(f, (*batch, m, n), jnp.dtype(out_dtype), a, b)
        outs[t._name(case)] = np.asarray(out.astype(jnp.float32))
        outs[t._name(case) + t.ALIASED] = np.asarray(aliased)
    np.savez(sys.argv[3], **outs)
""")


ALIASED = ":aliased"  # per case: whether the output really was the NaN-poisoned buffer
CHILD_TIMEOUT_S = 300  # all children together (about 25 s on an H200); a hung sum fails, not blocks
# Launch overrides a caller may have set that would change what the children run.
OVERRIDES = ("JAX_HOPPER_SPLIT_K_CLUSTER", "JAX_HOPPER_SPLIT_K_PIECES", "JAX_HOPPER_SPLIT_K_WAVES",
             "JAX_HOPPER_SMALL_M_WHOLE_A")


@pytest.fixture(scope="module")
def split_outputs(hopper_module, tmp_path_factory):
    """{(path, P): {case name: f32 copy of the output}}, one process per (path, P), run
    side by side."""
    here = pathlib.Path(__file__).resolve().parent
    tests_dir = f"{here}:{here.parent}"  # this module, and tests/ with the shared helpers
    tmp = tmp_path_factory.mktemp("split_k")
    # This process holds XLA's memory pool; the children allocate as they go.
    base = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    base["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    runs = {}
    try:
        for cluster in ("1", "0"):
            for pieces in PIECES:
                path, log = tmp / f"c{cluster}_p{pieces}.npz", tmp / f"c{cluster}_p{pieces}.log"
                env = {**base, "JAX_HOPPER_SPLIT_K_CLUSTER": cluster, "JAX_HOPPER_SPLIT_K_PIECES": str(pieces)}
                with open(log, "w") as sink:  # a file, not a pipe: a chatty child cannot block
                    proc = subprocess.Popen([sys.executable, "-c", _PROGRAM, tests_dir, json.dumps(CASES), str(path)],
                                            cwd="/", env=env, stdout=sink, stderr=subprocess.STDOUT)
                runs[("cluster" if cluster == "1" else "global", pieces)] = (proc, path, log)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        outputs = {}
        for key, (proc, path, log) in runs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{key} did not finish within {CHILD_TIMEOUT_S} s (a hung split-K sum?)")
            assert proc.returncode == 0, f"{key} failed:\n{log.read_text()[-3000:]}"
            with np.load(path) as saved:
                outputs[key] = dict(saved)
        return outputs
    finally:
        for proc, _, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("pieces", PIECES)
@pytest.mark.parametrize("case", CASES, ids=_name)
def test_cluster_sum_is_bitwise_the_global_sum(hopper, split_outputs, case, pieces):
    batch, m, n, k, _, out_dtype = case
    cluster = split_outputs[("cluster", pieces)][_name(case)]
    workspace = split_outputs[("global", pieces)][_name(case)]
    assert cluster.shape == (*batch, m, n)
    for path in ("cluster", "global"):
        assert split_outputs[(path, pieces)][_name(case) + ALIASED], f"{path}: the output was not the poisoned buffer"
    assert not np.isnan(cluster).any(), "an output element was never written (NaN poison left)"
    np.testing.assert_array_equal(cluster, workspace)
    a, b = _inputs(case)
    ref = f32_reference(a, b)
    err = relative_error(jnp.asarray(cluster), ref)
    err_jnp = relative_error(jnp.matmul(a, b, preferred_element_type=jnp.dtype(out_dtype)), ref)
    # f32 output: no final rounding, both errors are f32 summation noise (~1e-7); see
    # test_numerics_gpu.test_batched_and_f32_output_match_f32_reference for the band.
    assert err <= max(ERROR_FACTOR * err_jnp, 1e-5 if out_dtype == "float32" else 0), f"{err:.3e} vs {err_jnp:.3e}"


@pytest.mark.parametrize("case", [c for c in CASES if c[5] == "float32"], ids=_name)
def test_the_piece_override_changes_the_split(hopper, split_outputs, case):
    """Guards the test above: were JAX_HOPPER_SPLIT_K_PIECES ignored, every process would
    run the device's own split and agree trivially. Different piece counts add
    different partial sums, which some f32 outputs show in their last bits."""
    results = [split_outputs[("global", p)][_name(case)] for p in PIECES]
    for p, q, x, y in zip(PIECES, PIECES[1:], results, results[1:]):
        assert not np.array_equal(x, y), f"{p} and {q} pieces gave the same bits: the override did not split"

"""A handful of small products with partial tiles in M, N and K, for compute-sanitizer:
every kernel kind this build compiled (the experimental build: every kind), f16/bf16,
16-bit and f32 outputs, transposed layouts, a batch, odd K."""

import jax
import jax.numpy as jnp

from jax_hopper import _ffi
from jax_hopper.primitives.gemm import gemm

CASES = [  # (kernel, dtype, batch, m, n, k, transpose_a, transpose_b, out_dtype)
    ("v5", jnp.float16, 0, 129, 257, 72, False, False, None),
    ("v5", jnp.bfloat16, 0, 300, 520, 200, False, False, jnp.float32),
    ("persistent", jnp.float16, 0, 129, 257, 72, False, False, None),
    ("persistent", jnp.float16, 0, 300, 520, 200, False, True, None),
    ("persistent", jnp.bfloat16, 0, 200, 300, 136, True, False, jnp.float32),
    ("persistent", jnp.float16, 0, 136, 264, 520, True, True, None),
    ("persistent", jnp.float16, 2, 130, 260, 72, False, False, None),
    ("persistent", jnp.float16, 3, 200, 264, 136, False, False, jnp.float32),  # TMA store, batched f32
    ("persistent_basic", jnp.float16, 0, 300, 520, 200, False, False, None),
    ("persistent_tma", jnp.float16, 0, 300, 520, 200, False, False, jnp.float32),
    ("persistent_wait0", jnp.float16, 0, 129, 264, 72, False, False, None),
    ("persistent_immediate", jnp.float16, 0, 129, 264, 72, False, False, None),
    ("persistent_static", jnp.float16, 0, 129, 264, 72, False, False, None),
    # The default's dynamic order: tickets past the first wave, the mailbox between the
    # producers; a batch of transposed operands with f32 out (72 cluster tiles, 66 clusters).
    ("persistent", jnp.float16, 0, 4160, 4096, 192, False, False, None),
    ("persistent", jnp.bfloat16, 2, 2100, 1024, 136, True, True, jnp.float32),
    # The deferred store: 4 K tiles, rows past M in M tile 2 (the second warpgroup flushes only).
    ("persistent", jnp.float16, 0, 300, 8704, 200, False, False, None),
    ("persistent", jnp.bfloat16, 0, 1000, 8448, 72, False, False, None),  # 2 K tiles: 2 sub-tiles flushed
    ("persistent_streamk", jnp.float16, 0, 1000, 3000, 4160, False, False, None),  # tail split over clusters
    ("persistent_streamk", jnp.float16, 0, 16, 1024, 4160, False, False, None),  # split, one warpgroup idle
    ("persistent", jnp.float16, 0, 40, 520, 200, False, False, None),  # rows < 64: the second warpgroup passes
    ("persistent_pingpong", jnp.float16, 0, 300, 520, 200, False, False, None),  # whole tiles per warpgroup
    ("persistent_pingpong", jnp.float16, 0, 4160, 1024, 136, False, False, jnp.float32),  # past one wave
    ("persistent_f16acc", jnp.float16, 0, 300, 520, 200, False, False, None),  # four consumer warpgroups
    ("persistent_f16acc", jnp.float16, 2, 600, 264, 136, True, True, jnp.float32),
    # Split K through global memory (32 pieces, warps past M idle), then in clusters (on an
    # H200: 4 pieces over two M tiles with f32 out; 8 pieces, the largest cluster).
    ("small_m", jnp.float16, 0, 16, 1000, 4160, False, False, None),
    ("small_m", jnp.bfloat16, 0, 100, 264, 520, False, False, jnp.float32),
    ("small_m", jnp.float16, 0, 16, 256, 1024, False, False, None),
    # A's box trimmed to 8 rows (rows 5-7 zero-filled, 8-63 of the stage left as they were).
    ("small_m", jnp.float16, 0, 5, 1000, 520, False, False, None),
    # C rows TMA cannot store (the deferred store's copy_out): odd N with B [N, K] (no
    # padding), ticketed tiles with one K tile; N = 2 mod 8, batched.
    ("persistent", jnp.float16, 0, 300, 1001, 200, False, True, None),
    ("persistent", jnp.bfloat16, 0, 4160, 1001, 64, False, False, None),
    ("persistent", jnp.float16, 3, 200, 2002, 136, False, False, None),
    # Odd K: the K-outer operand keeps its K rows and TMA zero-fills past them.
    ("persistent", jnp.float16, 0, 300, 256, 101, False, False, None),  # B [K, N] short of padded K
    ("persistent", jnp.bfloat16, 2, 130, 264, 517, True, True, None),  # A [K, M] short, per batch entry
]

for kernel, dtype, batch, m, n, k, ta, tb, out_dtype in CASES:
    if not _ffi.kind_compiled(kernel):  # an ablation or experiment left out of this build
        print(kernel, "not compiled: skipped", flush=True)
        continue
    lead = (batch,) if batch else ()
    ka, kb = jax.random.split(jax.random.key(m * n + k))
    a = jax.random.normal(ka, lead + ((k, m) if ta else (m, k)), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, lead + ((n, k) if tb else (k, n)), jnp.float32).astype(dtype)
    out = jax.jit(lambda x, y: gemm(x, y, transpose_a=ta, transpose_b=tb, out_dtype=out_dtype, kernel=kernel))(a, b)
    out.block_until_ready()
    print(kernel, dtype.__name__, lead, m, n, k, ta, tb, out.dtype, "done", flush=True)

# The fused epilogue (bias, activation, residual) on partial tiles, with the register-
# store fallback (N = 101) and without, and past one wave (2100 x 2048: 72 cluster tiles
# for 66 clusters, ticketed).
import jax_hopper  # noqa: E402

for dtype, (m, n, k), act in [(jnp.float16, (129, 264, 72), "gelu_tanh"), (jnp.bfloat16, (100, 101, 103), "silu"),
                              (jnp.float16, (2100, 2048, 72), "relu")]:
    ka, kb, kc, kd = jax.random.split(jax.random.key(m + n), 4)
    x = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
    bias = jax.random.normal(kc, (n,), jnp.float32).astype(dtype)
    res = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
    with jax_hopper.dispatch("kernel"):
        out = jax.jit(lambda *a: jax_hopper.dense(a[0], a[1], a[2], activation=act, residual=a[3]))(x, w, bias, res)
    out.block_until_ready()
    print("dense", dtype.__name__, m, n, k, act, "done", flush=True)

# The backward form, dz = (g @ w^T) * act'(z), with and without the bias gradient summed
# in its epilogue, on partial tiles (M, N past a tile; odd K: g and w padded) and on
# 256 tiles, about two per CTA (the column-sum scratch reused from tile to tile).
from jax_hopper.primitives.dense_grad import fused_activation_grad  # noqa: E402

for dtype, (m, n, k), act, bias_grad in [(jnp.float16, (129, 264, 72), "gelu_exact", True),
                                         (jnp.bfloat16, (100, 104, 103), "relu", False),
                                         (jnp.float16, (300, 520, 200), None, True),  # None: times a saved act'
                                         (jnp.bfloat16, (2048, 4096, 64), "gelu_tanh", True)]:
    ka, kb, kc = jax.random.split(jax.random.key(m * k + n), 3)
    g = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(kb, (n, k), jnp.float32).astype(dtype)
    z = jax.random.normal(kc, (m, n), jnp.float32).astype(dtype)
    out = jax.jit(lambda *a: fused_activation_grad(*a, activation=act, bias_grad=bias_grad))(g, w, z)
    jax.block_until_ready(out)
    print("activation grad", dtype.__name__, m, n, k, act, "bias_grad" * bias_grad, "done", flush=True)

# The derivative form, act(x w + b) and act'(x w + b) as two TMA-stored outputs, on
# partial tiles (M, N past a tile; odd K: x and w padded).
from jax_hopper.primitives.dense_derivative import fused_dense_with_derivative  # noqa: E402

for dtype, (m, n, k), act in [(jnp.float16, (129, 264, 72), "gelu_exact"), (jnp.bfloat16, (300, 520, 103), "silu"),
                              (jnp.float16, (2100, 2048, 72), "gelu_tanh")]:  # ticketed
    ka, kb, kc = jax.random.split(jax.random.key(m * k + n + 1), 3)
    x = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kc, (n,), jnp.float32).astype(dtype)
    outs = jax.jit(lambda *a: fused_dense_with_derivative(*a, activation=act))(x, w, b)
    jax.block_until_ready(outs)
    print("derivative form", dtype.__name__, m, n, k, act, "done", flush=True)

# The grouped kinds (ragged_dot): skewed and empty groups, groups short of a tile, rows
# past the sizes (zeroed), rhs [G, N, K], the contraction's partial last K tile and empty
# groups, and the batched form's gap groups.
from jax_hopper.primitives.ragged_dot import ragged_contract, ragged_rows  # noqa: E402

if _ffi.kind_compiled("grouped"):
    for dtype, (m, k, n), sizes, transpose in [
            (jnp.float16, (1000, 136, 264), [300, 0, 7, 500, 100], False),
            (jnp.bfloat16, (513, 64, 128), [1, 2, 3, 0, 400], True)]:
        ka, kb = jax.random.split(jax.random.key(m + n))
        lhs = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
        rhs = jax.random.normal(kb, (len(sizes),) + ((n, k) if transpose else (k, n)), jnp.float32).astype(dtype)
        s = jnp.array(sizes, jnp.int32)
        jax.jit(lambda a, b, g: ragged_rows(a, b, g, transpose_rhs=transpose))(lhs, rhs, s).block_until_ready()
        jax.jit(lambda a, b, g: ragged_contract(a, b, g))(lhs, lhs[:, :n] if n <= k else lhs, s).block_until_ready()
        jax.jit(jax.vmap(lambda a, b, g: ragged_rows(a, b, g, transpose_rhs=transpose), in_axes=(0, None, None)))(
            jnp.stack([lhs, lhs]), rhs, s).block_until_ready()
        print("grouped", dtype.__name__, m, k, n, sizes, transpose, "done", flush=True)

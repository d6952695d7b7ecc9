"""A wrong answer from XLA's SPMD partitioner with no jax_hopper in it (found by
tests/fuzz.py, seed 101 case 1844, where it made jax's own result and the f32 reference
wrong alike): the gradient of a dot_general under vmap of lax.scan, one operand and the
cotangent sharded, differs from the same program on one device by the data's scale.

    python tools/repro_xla_scan_gradient.py            # 8 CPU devices (a 4x2 mesh)
    python tools/repro_xla_scan_gradient.py --gpu      # the machine's own devices (n/2 x 2)

Seen with jax 0.10.2 and 0.11.2 on 8 CPU devices under Shardy, jax's default partitioner
(5.37 off, results up to 10.8; 7.93 on a 2x2 mesh of 4 CPU devices; a 1x2 or 2x1 mesh
agrees); with JAX_USE_SHARDY_PARTITIONER=0 (GSPMD) the two agree.
Disabling XLA's while-loop-all-reduce-code-motion, while-loop-invariant-code-motion,
algebraic-simplifier or dot-merger changes nothing. Prints the largest difference and exits 1
where the sharded gradient is wrong."""

import os
import sys

if "--gpu" not in sys.argv:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

DIMS = (((3,), (2,)), ((1, 0), (3, 1)))  # K = 1, two batch dims, free dims of both


def product(x, y):
    """lax.dot_general under lax.scan over axis 0 of both, under vmap over rhs's axis 1."""
    def scanned(x, y):
        return lax.scan(lambda carry, s: (carry, lax.dot_general(*s, DIMS)), None, (x, y))[1]
    return jax.vmap(scanned, in_axes=(None, 1), out_axes=1)(x, y)


def main():
    if len(jax.devices()) < 4:
        raise SystemExit(f"needs 4 or more devices (both mesh axes > 1), found {len(jax.devices())}")
    mesh = jax.make_mesh((len(jax.devices()) // 2, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((2, 1, 1, 6, 1)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((2, 2, 8, 1, 1, 1, 2)), jnp.float32)
    g = jnp.asarray(rng.standard_normal(jax.eval_shape(product, lhs, rhs).shape), jnp.float32)

    def grad_lhs(a, b, g):
        return jax.vjp(product, a, b)[1](g)[0]

    one_device = jax.jit(grad_lhs)(lhs, rhs, g)
    sharded = jax.jit(grad_lhs)(lhs, jax.device_put(rhs, NamedSharding(mesh, P(*(None,) * 6, "y"))),
                                jax.device_put(g, NamedSharding(mesh, P(None, "y", None, None, None, "x", None))))
    diff = float(jnp.max(jnp.abs(sharded - one_device)))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}: max |sharded - one device| = {diff:.3g} "
          f"(results up to {float(jnp.max(jnp.abs(one_device))):.3g})")
    return 1 if diff > 1e-4 else 0


if __name__ == "__main__":
    sys.exit(main())

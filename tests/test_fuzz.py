"""scripts/fuzz_gpu.py, the differential fuzz: it runs on any machine (off a Hopper GPU
through the fallback, which still checks our ops' planning against lax.dot_general), and
it reports a wrong element rather than passing over it."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

import jax_hopper

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "fuzz_gpu.py"
SMALL = ["--max-flops", "2e7", "--seconds", "120"]  # a CPU's worth of work per case


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAMILIES = ["kind", "dot", "matmul", "vjp", "dense", "mlp", "sharded", "explicit"]


def test_the_families_are_these(fuzz):
    assert list(fuzz.FAMILIES) == FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_runs_clean(fuzz, family, tmp_path):
    if family in ("sharded", "explicit") and len(jax.devices()) < 2:
        pytest.skip(f"the {family} family needs two or more devices of the default platform")
    out = tmp_path / "fuzz.json"
    assert fuzz.main(SMALL + ["--families", family, "--cases", "5", "--seed", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["failures"] == 0 and [c["family"] for c in report["cases"]] == [family] * 5


@pytest.mark.parametrize("family,ops", [("kind", ["gemm"]), ("dot", ["dot_general"]), ("matmul", ["matmul", "dot"]),
                                        ("dense", ["dense"]), ("mlp", ["mlp"])])
def test_a_wrong_element_fails_its_case(fuzz, family, ops, monkeypatch, tmp_path):
    """One element of every result off by 5% of the result's largest (a wrong tile, row or
    stale element is off by the whole scale): every case fails."""
    def one_element_off(fn):
        def wrong(*args, **kwargs):
            out = fn(*args, **kwargs)
            bump = 0.05 * jnp.maximum(jnp.max(jnp.abs(out)), 1.0)
            return out.at[(0,) * out.ndim].add(bump.astype(out.dtype)) if out.size else out
        return wrong

    for op in ops:
        owner = fuzz if op == "gemm" else jax_hopper
        monkeypatch.setattr(owner, op, one_element_off(getattr(owner, op)))
    out = tmp_path / "fuzz.json"
    assert fuzz.main(SMALL + ["--families", family, "--cases", "4", "--json", str(out)]) == 1
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 4 and not any(c["ok"] for c in cases), [c["detail"] for c in cases]


def test_a_wrong_cotangent_fails_the_vjp_family(fuzz, monkeypatch, tmp_path):
    """The derivative checks too: the product's first cotangent off by 5% of its largest
    element in one place (a custom_vjp around dot_general) fails every vjp case."""
    plain = jax_hopper.dot_general

    def wrong_backward(x, y, dims, **kwargs):
        def product(x, y):
            return plain(x, y, dims, **kwargs)

        @jax.custom_vjp
        def f(x, y):
            return product(x, y)

        def fwd(x, y):
            return jax.vjp(product, x, y)

        def bwd(pullback, g):
            dx, dy = pullback(g)
            bump = 0.05 * jnp.maximum(jnp.max(jnp.abs(dx)), 1.0)
            return dx.at[(0,) * dx.ndim].add(bump.astype(dx.dtype)), dy

        f.defvjp(fwd, bwd)
        return f(x, y)

    monkeypatch.setattr(jax_hopper, "dot_general", wrong_backward)
    out = tmp_path / "fuzz.json"
    assert fuzz.main(SMALL + ["--families", "vjp", "--cases", "4", "--json", str(out)]) == 1
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 4 and not any(c["ok"] for c in cases), [c["detail"] for c in cases]

"""scripts/fuzz_gpu.py, the differential fuzz: it runs on any machine (off a Hopper GPU
through the fallback, which still checks our ops' planning against lax.dot_general), and
it reports a wrong element rather than passing over it."""

from __future__ import annotations

import importlib.util
import json
import pathlib

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


def test_every_family_runs_clean(fuzz, tmp_path):
    out = tmp_path / "fuzz.json"
    families = list(fuzz.FAMILIES)
    # Cases pick their family at random: enough of them that each family is drawn.
    assert fuzz.main(SMALL + ["--cases", "30", "--seed", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["failures"] == 0 and len(report["cases"]) == 30
    assert {c["family"] for c in report["cases"]} == set(families)


@pytest.mark.parametrize("family", ["dot", "kind"])
def test_a_wrong_element_fails_its_case(fuzz, family, monkeypatch, tmp_path):
    """One element off by a little more than rounding allows, in every result."""
    def off_by_a_bit(fn):
        def wrong(*args, **kwargs):
            out = fn(*args, **kwargs)
            bump = 0.05 * jnp.maximum(jnp.max(jnp.abs(out)), 1.0)
            return out.at[(0,) * out.ndim].add(bump.astype(out.dtype)) if out.size else out
        return wrong

    if family == "dot":
        monkeypatch.setattr(jax_hopper, "dot_general", off_by_a_bit(jax_hopper.dot_general))
    else:
        monkeypatch.setattr(fuzz, "gemm", off_by_a_bit(fuzz.gemm))
    out = tmp_path / "fuzz.json"
    assert fuzz.main(SMALL + ["--families", family, "--cases", "4", "--json", str(out)]) == 1
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 4 and not any(c["ok"] for c in cases), [c["detail"] for c in cases]

"""The documents against what they describe (CPU only, seconds).

- docs/performance.md and README.md's table of current numbers are what
  tools/perf_tables.py writes from docs/results/current (and each number there is its
  source record's);
- docs/dispatch.md is what tools/dispatch_doc.py writes from the rule table;
- README.md's Python blocks run, in order, in one namespace, on a CPU, against the
  installed package (off a Hopper GPU our ops compute through XLA's dot);
- docs/results/evidence/README.md names exactly the files beside it.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
EVIDENCE = ROOT / "docs" / "results" / "evidence"


def test_performance_tables_are_current():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "perf_tables.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_dispatch_rules_doc_is_current(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "dispatch_doc.py"), "--check"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def readme_python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.M | re.S)


def test_readme_code_runs_on_a_cpu(tmp_path):
    blocks = readme_python_blocks()
    assert blocks, "README.md has no ```python block"
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n\n".join(blocks))
    # From a directory outside the repository, so `import jax_hopper` finds the installed
    # package; with the default dispatch policy, as a user's program has it (conftest sets
    # JAX_HOPPER_DISPATCH for the other tests).
    env = {k: v for k, v in os.environ.items() if k != "JAX_HOPPER_DISPATCH"}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"README.md's code failed:\n{result.stdout}\n{result.stderr}"


def test_the_evidence_index_names_exactly_the_evidence_files():
    index = (EVIDENCE / "README.md").read_text()
    named = {n for n in re.findall(r"`([^`/]+\.(?:json|txt))`", index) if "*" not in n}
    present = {p.name for p in EVIDENCE.iterdir() if p.name != "README.md"}
    assert named - present == set(), f"named in evidence/README.md but absent: {sorted(named - present)}"
    assert present - named == set(), f"in docs/results/evidence but not named in its README: {sorted(present - named)}"

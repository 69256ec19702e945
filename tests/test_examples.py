"""Every script in examples/ runs, in its small mode (seconds), and prints the final accuracy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    env = {**os.environ, "DTURBO_EXAMPLE_SMALL": "1", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "out")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "accuracy " in proc.stdout and "density " in proc.stdout, proc.stdout
    assert (tmp_path / "out").is_dir()


@pytest.mark.slow
def test_models_doc_snippet_runs(tmp_path):
    """docs/models.md's first python block, run from an empty folder (it needs no file of the repository)."""
    text = (ROOT / "docs" / "models.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracy, density = (float(v) for v in proc.stdout.split())
    assert 0 <= accuracy <= 1 and 0 < density < 1
    assert (tmp_path / "runs" / "library_demo" / "metrics.csv").exists()

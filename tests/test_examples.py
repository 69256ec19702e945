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
    assert accuracy >= 0.25 + 0.25, accuracy  # 4 classes: chance is 25%; the example ends 25 points above it
    assert 0 < density < 1
    assert (tmp_path / "runs" / "library_demo" / "metrics.csv").exists()


def _python_blocks(path: Path) -> list[str]:
    return [b.split("```", 1)[0] for b in path.read_text().split("```python\n")[1:]]


# What the docs' blocks leave to the reader: their data (here 2000 Fashion-MNIST training images, 500 test) and, for
# README's, a model (docs/models.md's residual Net).
DATA_PRELUDE = """
from dturbo.data import load_dataset
_d = load_dataset("fashion-mnist", limit_train=2000, limit_test=500)
x_train, y_train, x_test, y_test = _d.x_train, _d.y_train, _d.x_test, _d.y_test
"""


@pytest.mark.slow
@pytest.mark.parametrize("doc", ["README.md", "docs/models.md"])
def test_docs_blocks_that_train_a_model_end_above_chance(doc, tmp_path):
    """README's own-model block and docs/models.md's residual-network block, run as written on real data: 10
    classes, chance is 10%; each ends at least 40 points above it."""
    from dturbo.data.readers import FASHION_MNIST_PATH

    if not Path(FASHION_MNIST_PATH).exists():
        pytest.skip("Fashion-MNIST is not installed (Debian package dataset-fashion-mnist)")
    net = _python_blocks(ROOT / "docs" / "models.md")[1]
    if doc == "README.md":
        code = DATA_PRELUDE + net.split("result = ", 1)[0] + _python_blocks(ROOT / "README.md")[0]
    else:
        code = DATA_PRELUDE + "import dturbo\nconfig = dturbo.load_config({'experiment': {'rounds': 12}})\n" + net
        code += "\nprint(result.accuracy, result.density)\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracy, density = (float(v) for v in proc.stdout.split()[-2:])
    assert accuracy >= 0.10 + 0.40, proc.stdout + proc.stderr[-2000:]
    assert 0 < density < 1

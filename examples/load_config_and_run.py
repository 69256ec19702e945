"""A shipped config, changed from Python: dturbo.load_config with overrides (the keys of `dturbo run --set`).

    python examples/load_config_and_run.py            # configs/fmnist_quick.toml, shortened (a few minutes)
    python examples/load_config_and_run.py --small    # a few seconds (also: DTURBO_EXAMPLE_SMALL=1)

Real Fashion-MNIST is used where it is installed (/usr/share/datasets/fashion-mnist); elsewhere the example
writes a small synthetic .npz and points data.path at it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np

import dturbo

ROOT = Path(__file__).resolve().parents[1]
FMNIST = Path("/usr/share/datasets/fashion-mnist")


def synthetic_npz(folder: Path) -> Path:
    """A stand-in for Fashion-MNIST: 28x28 uint8 images of 10 classes (a bright stripe per class)."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, 1200)
    x = rng.integers(0, 100, (1200, 28, 28))
    for c in range(10):
        x[y == c, 2 * c + 4: 2 * c + 8, :] += 150
    path = folder / "synthetic.npz"
    np.savez(path, x_train=x[:1000].astype(np.uint8), y_train=y[:1000], x_test=x[1000:].astype(np.uint8),
             y_test=y[1000:])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", default=os.environ.get("DTURBO_EXAMPLE_SMALL") == "1",
                        help="a run of a few seconds (for tests)")
    parser.add_argument("--out", default=None, help="run directory (default: a new temporary folder)")
    args = parser.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="dturbo_config_"))
    overrides: dict[str, object] = {"experiment.rounds": 2 if args.small else 6,
                                    "dturbo.sparsity.ramp_rounds": 1 if args.small else 4}
    if args.small:
        overrides.update({"data.limit_train": 500, "data.limit_test": 200, "train.local_steps": 2,
                          "federation.clients": 4})
    if not (FMNIST / "train-images-idx3-ubyte.gz").exists():
        overrides.update({"data.name": "npz", "data.path": synthetic_npz(out.parent if args.out else out)})
    config = dturbo.load_config(ROOT / "configs" / "fmnist_quick.toml", overrides)
    print(f"{config.experiment.name}: {config.experiment.rounds} rounds on {config.data.name}, "
          f"target density {config.dturbo.sparsity.target_density}")
    result = dturbo.Experiment(config, out=out / "run", figures=not args.small).run()
    print(f"accuracy {result.accuracy:.4f}, density {result.density:.3f}; run directory {result.out}")


if __name__ == "__main__":
    main()

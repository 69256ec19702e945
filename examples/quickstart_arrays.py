"""D-Turbo-VBI on arrays in memory: synthetic images, 10 clients, a sparse global model.

    python examples/quickstart_arrays.py              # about half a minute on a 2-core CPU
    python examples/quickstart_arrays.py --small      # a few seconds (also: DTURBO_EXAMPLE_SMALL=1)

The arrays go to dturbo.Experiment exactly as an .npz file's would (numpy arrays or torch tensors; images N,H,W,
N,C,H,W or N,H,W,C, or flat N,D; integer labels 0..K-1). docs/api.md has the whole API.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

import dturbo


def synthetic_images(n: int, classes: int = 4, size: int = 14, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (N, H, W): each class a bright square in its own place, on noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.integers(0, 120, (n, size, size))
    half = size // 2
    for c in range(classes):
        r, k = divmod(c, 2)
        x[y == c, r * half:(r + 1) * half, k * half:(k + 1) * half] += 120
    return x.astype(np.uint8), y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", default=os.environ.get("DTURBO_EXAMPLE_SMALL") == "1",
                        help="a run of a few seconds (for tests)")
    parser.add_argument("--out", default=None, help="run directory (default: a new temporary folder)")
    args = parser.parse_args()

    n, rounds = (400, 2) if args.small else (4000, 10)
    x, y = synthetic_images(n + n // 4)
    data = (x[:n], y[:n], x[n:], y[n:])  # train, test
    config = {
        "experiment": {"name": "quickstart_arrays", "rounds": rounds, "algorithm": "dturbo"},
        "federation": {"clients": 10 if not args.small else 4, "partition": "dirichlet", "alpha": 0.5},
        "model": {"name": "lenet5"},
        "train": {"local_steps": 2 if args.small else 20, "batch_size": 32, "lr": 0.003},
        # the support shrinks from dense to 30% of the weights over rounds 1..ramp (docs/sparsity.md)
        "dturbo": {"sparsity": {"target_density": 0.3, "warmup_rounds": 0, "ramp_rounds": rounds}},
    }
    out = args.out or tempfile.mkdtemp(prefix="dturbo_quickstart_")
    result = dturbo.Experiment(config, data=data, out=out, figures=not args.small).run()
    total_bits = result.metrics[-1]["cum_bits"]
    print(f"accuracy {result.accuracy:.4f}, density {result.density:.3f} (nonzero weights), "
          f"{total_bits / 1e6:.2f} Mbit up + down; run directory {out}")


if __name__ == "__main__":
    main()

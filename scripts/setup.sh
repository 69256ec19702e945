#!/usr/bin/env bash
# Set up everything dturbo needs on a fresh machine (idempotent):
#   - the Debian package with real Fashion-MNIST (when apt-get is available and we are root),
#   - a virtual environment in .venv with the pinned CPU torch FIRST (an unpinned torch would pull a
#     multi-GB CUDA build), then the project with its test extras, Flower and Flower's simulation engine
#     (flwr[simulation]: ray, a 74 MB wheel).
set -euo pipefail
cd "$(dirname "$0")/.."

FMNIST=/usr/share/datasets/fashion-mnist
if [ ! -f "$FMNIST/train-images-idx3-ubyte.gz" ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing dataset-fashion-mnist (Debian package)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) >/dev/null \
      || echo "[setup] WARNING: could not install dataset-fashion-mnist; real-data tests will be skipped"
  else
    echo "[setup] WARNING: $FMNIST missing and apt-get unavailable; real-data tests will be skipped"
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
pip_install() {  # quiet on success, the whole log on failure
  if ! .venv/bin/python -m pip --disable-pip-version-check -q install "$@" >.venv/pip.log 2>&1; then
    cat .venv/pip.log; echo "[setup] pip install $* failed"; exit 1
  fi
}
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU)"
  pip_install "torch==2.13.0"
fi
echo "[setup] installing dturbo and its test extras (with flwr and ray)"
pip_install -e ".[test,flower,simulation]"
.venv/bin/python -c "import dturbo, torch; print(f'[setup] dturbo {dturbo.__version__}, torch {torch.__version__}')"
# The native conv kernel (dturbo.native) is compiled here, once per installed copy, so that no later import or export load
# waits for the compiler; where it cannot be built, dturbo runs PyTorch's kernels and says why.
echo "[setup] building the native conv kernel"
.venv/bin/python -c "from dturbo import native; r = native.unavailable_reason(); print('[setup] native kernel: ' + (r or 'built'))"

"""Hostile exported model directories and data files: sizes checked against the tensors present before anything is
allocated, NaN weights and symbolic links out of the folder refused, every malformed input an ExportError; a deflated
.npz whose arrays do not match refused from its headers, before it is inflated."""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dturbo import export as ex
from dturbo.data import DataError, load_dataset
from dturbo.nn.models import build_model


def _export(tmp_path: Path) -> Path:
    """An honest export of a seeded LeNet-5 (built-in format)."""
    from dturbo.rundir import RunDir
    from dturbo.settings import load_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config({"model": {"name": "lenet5"}, "data": {"name": "fashion-mnist"}})
    (run / "config.toml").write_text(cfg.to_toml())
    model = build_model("lenet5", (1, 28, 28), 10, seed=0)
    RunDir(run).save_model(model, cfg, None)
    out = tmp_path / "model"
    ex.export_run(run, out)
    return out


def _copy(src: Path, dst: Path, spec=None, tensors=None) -> Path:
    dst.mkdir()
    (dst / "model.json").write_text(json.dumps(spec if spec is not None else json.loads(
        (src / "model.json").read_text())))
    save_file(tensors if tensors is not None else load_file(str(src / "model.safetensors")),
              str(dst / "model.safetensors"), metadata={"format": "dturbo-export"})
    return dst


def test_hostile_model_directories_are_refused_before_they_cost_memory(tmp_path):
    honest = _export(tmp_path)
    ex.load(honest, compile=False, batch_size=8)
    spec = json.loads((honest / "model.json").read_text())
    cases = {}
    big = json.loads(json.dumps(spec))
    conv = next(op for op in big["ops"] if op["type"] == "conv2d")
    conv["in_channels"] = conv["out_channels"] = 12000
    cases["claims 12000 channels"] = (_copy(honest, tmp_path / "conv", big), "has shape")
    wide = json.loads(json.dumps(spec))
    wide["input_shape"], wide["input_norm"] = [1, 3000, 3000], None
    cases["input 3000 x 3000"] = (_copy(honest, tmp_path / "wide", wide), "smaller batch_size|does not run")
    graph = {"format": "dturbo-export", "version": 4, "input_shape": [1, 28, 28], "num_classes": 10,
             "ops": [{"type": "input", "name": "x", "args": []},
                     {"type": "layer_norm", "name": "ln", "args": [{"ref": "x"}],
                      "attrs": {"normalized_shape": [30000, 30000], "eps": 1e-5, "weight": True, "bias": True}},
                     {"type": "output", "name": "output", "args": [{"ref": "ln"}]}]}
    cases["LayerNorm 30000 x 30000"] = (_copy(honest, tmp_path / "ln", graph, {"z": torch.zeros(1)}), "no tensor")
    nested = tmp_path / "nested"
    _copy(honest, nested)
    (nested / "model.json").write_text("[" * 100_000 + "]" * 100_000)
    cases["nested JSON"] = (nested, "nests")
    tensors = load_file(str(honest / "model.safetensors"))
    key = next(k for k in tensors if k.endswith(".weight"))
    cases["NaN weights"] = (_copy(honest, tmp_path / "nan", None, tensors | {key: torch.full_like(tensors[key],
                                                                                                   float("nan"))}),
                            "NaN")
    link = tmp_path / "link"
    link.mkdir()
    (link / "model.json").write_text((honest / "model.json").read_text())
    (link / "model.safetensors").symlink_to(honest / "model.safetensors")
    cases["a weights file linked from outside"] = (link, "symbolic link out of")
    for what, (folder, match) in cases.items():
        t0 = time.perf_counter()
        with pytest.raises(ex.ExportError, match=match):
            ex.load(folder, compile=False)
        assert time.perf_counter() - t0 < 10, what
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "model.json").write_text((honest / "model.json").read_text())
    (inside / "weights").mkdir()
    (inside / "weights" / "w.safetensors").write_bytes((honest / "model.safetensors").read_bytes())
    (inside / "model.safetensors").symlink_to(inside / "weights" / "w.safetensors")
    ex.load(inside, compile=False, batch_size=8)  # a link inside the folder is the folder's own file


def test_a_deflated_npz_whose_arrays_do_not_match_is_refused_before_it_is_inflated(tmp_path):
    path = tmp_path / "bomb.npz"
    rows, cols = 200_000, 4000  # 800 MB of zeros, a few hundred kB deflated
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        with z.open("x_train.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False, "shape": (rows, cols)})
            block = bytes(cols * 10_000)
            for _ in range(rows // 10_000):
                f.write(block)
        for name, arr in (("y_train", np.zeros(7, np.int64)), ("x_test", np.zeros((5, cols), np.uint8)),
                          ("y_test", np.zeros(5, np.int64))):
            with z.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, arr)
    assert path.stat().st_size < 5 << 20
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"\(200000 rows\) but y_train has 7 rows"):
        load_dataset("npz", path)
    assert time.perf_counter() - t0 < 2
    lying = tmp_path / "lying.npz"
    with zipfile.ZipFile(lying, "w") as z:
        with z.open("x_train.npy", "w") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10)})
            f.write(bytes(40))
    with pytest.raises(DataError, match="header says shape"):
        load_dataset("npz", lying)

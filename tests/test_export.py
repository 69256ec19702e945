"""``dturbo export`` and the exported inference model (issue 4): compaction across layers, equality with the
masked dense model on random and real inputs, every kernel, the file format (no pickle), load errors."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import dturbo
from dturbo import export as ex
from dturbo.cli import app
from dturbo.kernels import CONV_KERNELS, KERNELS, PanelLinear, column_runs, direct_supported, make_linear
from dturbo.nn.bayes import BayesianLayer
from dturbo.nn.models import build_model

FMNIST = Path("/usr/share/datasets/fashion-mnist")
SHAPE = (1, 28, 28)
TOL = 1e-4
# Fashion-MNIST's training statistics as dturbo.data.load_dataset computes them
FMNIST_NORM = {"raw_dtype": "uint8", "scale": 255.0, "mean": [0.28604059698879547], "std": [0.3530242445149226]}


def cluster_mask(shape: tuple[int, ...], gen: torch.Generator, block: int = 4, p: float = 0.6) -> torch.Tensor:
    """Random clusters: Bernoulli(p) blocks of ``block`` x ``block`` on the layer's grid (out x rest)."""
    rows, cols = shape[0], int(torch.tensor(shape[1:]).prod())
    coarse = (torch.rand((rows + block - 1) // block, (cols + block - 1) // block, generator=gen) < p).float()
    grid = coarse.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return grid.reshape(shape).contiguous()


def alexnet_state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """An alexnet-small state whose masks (and zero weights) force every kind of removal. Expected after
    compaction: conv1 6->3, conv3 32->30, conv4 64->47, dense1 120x256 -> 90x188, dense2 84x120 -> 73x90."""
    model = build_model("alexnet-small", SHAPE, 10, seed=1)
    s = {k: v.clone() for k, v in model.state_dict().items()}
    for k in list(s):
        if k.endswith(".mask"):
            s[k] = cluster_mask(tuple(s[k].shape), gen)
        if k.endswith(".bias"):
            s[k] = torch.randn(s[k].shape, generator=gen) * 0.3
    s["conv1.mask"][4] = 0
    s["conv1.bias"][4] = 0.0  # constant 0 channel before a padded conv: removable
    s["conv1.mask"][2] = 0
    s["conv1.bias"][2] = 0.3  # constant nonzero channel before a padded conv: folded into conv2's bias map
    s["conv2.mask"][:, 1] = 0  # conv1 channel 1 unused -> removed
    s["conv3.mask"][7] = 0
    s["conv3.bias"][7] = -0.5  # leaky_relu(-0.5) != 0, padded consumer: folded into conv4's bias map
    s["conv4.mask"][:, 9] = 0  # conv3 channel 9 unused -> removed
    s["conv4.mask"][10:20] = 0  # constants folded through pool + flatten into dense1's bias
    s["dense1.mask"][:, 30 * 4 : 36 * 4] = 0  # conv4 channels 30..35 unused
    s["dense1.mask"][:, 160:164] = 0
    s["dense1.mask"][100:110, 160:164] = 1  # conv4 channel 40 used only by dense1 rows 100..109 ...
    s["dense2.mask"][:, 100:110] = 0  # ... which dense2 never reads: a backward chain removes channel 40
    s["dense1.mask"][0:20] = 0  # constant rows folded into dense2
    s["dense2.mask"][70] = 0
    s["dense2.mask"][70, 0:20] = 1  # dense2 row 70 reads only those rows: a forward chain removes it
    s["dense2.weight_mu"][50:60] = 0.0  # exact zeros in mu with mask 1 (how baselines prune)
    s["dense3.mask"] = torch.ones(10, 84)
    s["dense3.mask"][3] = 0  # a zero logit row stays
    return s


def write_run(root: Path, model_name: str, state: dict[str, torch.Tensor], *,
              input_norm: dict | None = FMNIST_NORM, **model_kw: object) -> Path:
    """A run directory as `dturbo run` leaves it: config.toml + model.safetensors."""
    cfg = dturbo.Config()
    cfg.model.name = model_name
    for k, v in model_kw.items():
        setattr(cfg.model, k, v)
    cfg.data.name = "fashion-mnist"
    cfg.data.path = str(FMNIST)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.toml").write_text(cfg.to_toml())
    meta = {"model": model_name, "dataset": "fashion-mnist", "algorithm": "dturbo"}
    if input_norm is not None:  # as `dturbo run` stores it: export then reads no data
        meta["input_norm"] = json.dumps(input_norm)
    save_file({k: v.contiguous() for k, v in state.items()}, str(root / "model.safetensors"), metadata=meta)
    return root


def reference(run: Path, model_name: str, **kw: object) -> torch.nn.Module:
    """The masked dense model: the Bayesian network itself in eval mode."""
    model = build_model(model_name, SHAPE, 10, **kw)
    model.load_state_dict(load_file(str(run / "model.safetensors")))
    return model.eval()


@pytest.fixture(scope="module")
def alexnet_run(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("runs") / "alex", "alexnet-small",
                     alexnet_state(torch.Generator().manual_seed(0)))


@pytest.fixture(scope="module")
def alexnet_export(alexnet_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exp") / "alex"
    ex.export_run(alexnet_run, out)
    return out


@pytest.fixture(scope="module")
def fmnist_images() -> torch.Tensor:
    if not (FMNIST / "t10k-images-idx3-ubyte.gz").exists() and not (FMNIST / "t10k-images-idx3-ubyte").exists():
        pytest.skip("real Fashion-MNIST not installed")
    from dturbo.data import load_dataset

    ds = load_dataset("fashion-mnist", str(FMNIST), limit_train=1000, limit_test=500, seed=0)
    return torch.from_numpy(ds.x_test)


def random_images(n: int = 48) -> torch.Tensor:
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(5)) * 2


def max_err(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


# ------------------------------------------------------------------------------------------------ compaction
def test_shapes_shrink_across_layers_as_the_masks_dictate(alexnet_export):
    spec = json.loads((alexnet_export / "model.json").read_text())
    after = {r["name"]: tuple(r["shape_after"]) for r in spec["layers"]}
    assert after == {
        "conv1": (3, 1, 7, 7), "conv2": (16, 3, 5, 5), "conv3": (30, 16, 3, 3), "conv4": (47, 30, 3, 3),
        "dense1": (90, 188), "dense2": (73, 90), "dense3": (10, 73),
    }
    tensors = load_file(str(alexnet_export / "model.safetensors"))
    assert tuple(tensors["dense1.weight"].shape) == (90, 188)
    # the constant channels' contributions to the padded conv2 / conv4 are per-position maps
    assert tuple(tensors["conv2.bias_map"].shape) == (16, 13, 13)
    assert tuple(tensors["conv4.bias_map"].shape) == (47, 6, 6)
    border, inside = tensors["conv2.bias_map"][:, 0, 0], tensors["conv2.bias_map"][:, 6, 6]
    assert not torch.allclose(border, inside)  # not a plain bias: the padding makes the borders differ
    assert "conv1.bias_map" not in tensors and "conv3.bias_map" not in tensors
    assert spec["totals"]["weights_after"] < spec["totals"]["weights_before"]
    assert spec["totals"]["density_after"] > spec["totals"]["density_before"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("channels_last", [False, True])
def test_exported_equals_masked_model_for_every_kernel(alexnet_run, alexnet_export, kernel, channels_last):
    ref = reference(alexnet_run, "alexnet-small")
    conv = CONV_KERNELS[KERNELS.index(kernel) % len(CONV_KERNELS)]
    if conv == "direct" and not direct_supported(torch.nn.Conv2d(1, 6, 7, padding=3)):
        conv = "default"  # no native build on this machine (tests/test_native.py says why)
    model = ex.load(alexnet_export, kernels=kernel, channels_last=channels_last, compile=False, conv=conv)
    assert not model.training and model.channels_last == channels_last
    assert {model.kernels[n] for n in ("dense1", "dense2", "dense3")} == {kernel}
    assert {model.kernels[f"conv{i}"] for i in range(1, 5)} == {conv}  # every one: stride 1, a square kernel
    assert max_err(model, ref, random_images()) <= TOL
    assert max_err(model, ref, random_images(1)) <= TOL  # batch 1 (after a call: the in-place bias maps kept)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    maps = [m for m in model.net.modules() if isinstance(m, ex.BiasMap)]
    assert len(maps) == 2 and all(m.bias_map.is_contiguous(memory_format=fmt) for m in maps)


def test_exported_equals_masked_model_on_real_images(alexnet_run, alexnet_export, fmnist_images):
    ref = reference(alexnet_run, "alexnet-small")
    model = ex.load(alexnet_export, batch_size=len(fmnist_images), compile=False)  # auto kernels, auto format
    assert set(model.kernels.values()) <= {*KERNELS, *CONV_KERNELS}
    assert all(model.kernels[f"conv{i}"] in CONV_KERNELS for i in range(1, 5))
    assert set(model.info["layers"]) == {"conv1", "conv2", "conv3", "conv4", "dense1", "dense2", "dense3",
                                         "pool1", "pool2", "pool4"}
    assert max_err(model, ref, fmnist_images) <= TOL
    with torch.no_grad():
        assert torch.equal(model(fmnist_images).argmax(1), ref(fmnist_images).argmax(1))


def test_no_bayesian_layers_and_no_training_code_needed(alexnet_export, monkeypatch):
    for mod in ("dturbo.nn", "dturbo.nn.bayes", "dturbo.nn.models", "dturbo.vbi", "dturbo.sim"):
        monkeypatch.setitem(sys.modules, mod, None)  # importing any of them now raises ImportError
    model = ex.load(alexnet_export, kernels="dense", compile=False, channels_last=False)
    assert isinstance(model, torch.nn.Module)
    assert {type(m).__module__.split(".")[0] for m in model.net.children()} <= {"torch", "dturbo"}
    assert not any(isinstance(m, BayesianLayer) for m in model.modules())
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_conv_to_conv_fold_without_padding_lenet(tmp_path, fmnist_images):
    gen = torch.Generator().manual_seed(3)
    model = build_model("lenet5", SHAPE, 10, seed=2)
    s = {k: v.clone() for k, v in model.state_dict().items()}
    s["conv1.mask"][3] = 0
    s["conv1.bias"][3] = 0.5  # constant channel into conv2 (padding 0): folded exactly
    s["conv2.mask"][5:9] = 0
    s["conv2.bias"][5:9] = torch.tensor([0.2, -0.4, 0.0, 1.0])  # folded through pool+flatten into dense1
    s["dense1.mask"] = cluster_mask((120, 400), gen)
    run = write_run(tmp_path / "run", "lenet5", s)
    out = ex.export_run(run, tmp_path / "model")
    after = {r["name"]: tuple(r["shape_after"]) for r in out.layers}
    assert after["conv1"] == (5, 1, 5, 5) and after["conv2"] == (12, 5, 5, 5) and after["dense1"] == (120, 300)
    ref = reference(run, "lenet5")
    m = ex.load(tmp_path / "model", compile=False, channels_last=True)
    assert max_err(m, ref, random_images()) <= TOL
    assert max_err(m, ref, fmnist_images) <= TOL


def test_mlp_drops_unused_pixels_and_hidden_units(tmp_path):
    hidden = [64, 32]
    model = build_model("mlp", SHAPE, 10, hidden=hidden, seed=4)
    s = {k: v.clone() for k, v in model.state_dict().items()}
    s["dense1.mask"].view(64, 28, 28)[:, :3, :] = 0  # top 3 image rows never used: 84 of 784 pixels
    s["dense1.mask"][10:14] = 0
    s["dense1.bias"][10:14] = torch.tensor([0.5, -1.0, 0.0, 2.0])
    s["dense2.mask"][:, 40:44] = 0
    run = write_run(tmp_path / "run", "mlp", s, hidden=hidden)
    exported = ex.export_run(run, tmp_path / "model")
    assert [op.type for op in exported.ops][:2] == ["flatten", "input_select"]
    after = {r["name"]: tuple(r["shape_after"]) for r in exported.layers}
    assert after == {"dense1": (56, 700), "dense2": (32, 56), "dense3": (10, 32)}
    ref = reference(run, "mlp", hidden=hidden)
    for kernel in KERNELS:
        m = ex.load(tmp_path / "model", kernels=kernel)
        assert not m.compiled and not m.channels_last  # no convolutions: nothing to gain
        assert max_err(m, ref, random_images()) <= TOL


def test_all_ones_masks_stay_dense(tmp_path, fmnist_images):
    """A baseline (FedAvg): nothing to remove, dense kernels everywhere, same function."""
    model = build_model("alexnet-small", SHAPE, 10, seed=6)
    run = write_run(tmp_path / "run", "alexnet-small", dict(model.state_dict()))
    exported = ex.export_run(run, tmp_path / "model")
    assert all(r["shape_before"] == r["shape_after"] and r["density_after"] == 1.0 for r in exported.layers)
    m = ex.load(tmp_path / "model", batch_size=64, compile=False, channels_last=False)
    assert {m.kernels[n] for n in ("dense1", "dense2", "dense3")} == {"dense"}
    assert max_err(m, reference(run, "alexnet-small"), fmnist_images) <= TOL


def test_compaction_off_keeps_every_unit(alexnet_run, tmp_path):
    exported = ex.export_run(alexnet_run, tmp_path / "dense", compaction=False)
    assert all(r["shape_before"] == r["shape_after"] for r in exported.layers)
    m = ex.load(tmp_path / "dense", kernels="dense", compile=False, channels_last=False)
    assert max_err(m, reference(alexnet_run, "alexnet-small"), random_images()) <= TOL


def test_compiled_model_matches(tmp_path, monkeypatch):
    """The compiled path (dynamo tracing, graph breaks at the sparse kernels). The eager backend keeps the test
    fast; inductor's own output is checked against the masked model by benchmarks/bench_inference.py."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    state = build_model("mlp", SHAPE, 10, hidden=[16], seed=8).state_dict()
    state["dense1.mask"] = cluster_mask((16, 784), torch.Generator().manual_seed(8), p=0.3)
    run = write_run(tmp_path / "run", "mlp", state, hidden=[16])
    ex.export_run(run, tmp_path / "model")
    m = ex.load(tmp_path / "model", batch_size=16, kernels="panel", compile=True)
    assert m.compiled or "compile_error" in m.info
    assert max_err(m, reference(run, "mlp", hidden=[16]), random_images(16)) <= TOL


def test_cuda_graph_arguments_are_checked(alexnet_export):
    with pytest.raises(ValueError, match="cuda_graph=True needs device='cuda'"):
        ex.load(alexnet_export, cuda_graph=True, compile=False)
    m = ex.load(alexnet_export, compile=False, channels_last=False)  # on a CPU, auto means no graph
    assert not m.graphed
    with pytest.raises(ValueError, match="needs a model and inputs on a CUDA device"):
        m.set_graphed(random_images(4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager(alexnet_run, alexnet_export, monkeypatch):
    """The replayed graph computes the same function as the eager pass (same kernels: bit for bit), on fresh
    inputs each time (not the captured ones); other batch sizes run eagerly; each call's result is its own."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 convolutions, for TOL
    with pytest.raises(ValueError, match="choose one"):
        ex.load(alexnet_export, device="cuda", cuda_graph=True, compile=True)
    m = ex.load(alexnet_export, batch_size=16, device="cuda", compile=False, channels_last=False, cuda_graph=True)
    assert m.graphed
    # asked for, the graph is captured: torch.compile's automatic choice is not tried instead
    auto = ex.load(alexnet_export, batch_size=16, device="cuda", channels_last=False, cuda_graph=True)
    assert auto.graphed and not auto.compiled
    ref = reference(alexnet_run, "alexnet-small").cuda()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        first = None
        for n in (16, 16, 5):
            x = (torch.randn(n, *SHAPE, generator=gen) * 2).cuda()
            out = m(x)
            m._graph, graph = None, m._graph
            eager = m(x)
            m._graph = graph
            assert torch.equal(out, eager)
            assert float((out - ref(x)).abs().max()) <= TOL
            if first is None:
                first, first_copy = out, out.clone()
        assert torch.equal(first, first_copy)  # not overwritten by the later replays
    m.set_graphed(None)
    assert not m.graphed
    m.set_graphed(x)
    m.set_channels_last(True)  # a new memory format: the captured graph is dropped, not replayed stale
    assert not m.graphed and float((m(x) - ref(x)).abs().max()) <= TOL


# ------------------------------------------------------------------------------------------------ kernels
def test_panel_runs_and_kernels_on_clustered_weights():
    assert column_runs([False, True, True, False, False, True, False], max_gap=1) == [(1, 3), (5, 6)]
    assert column_runs([True, False, False, True], max_gap=2) == [(0, 4)]
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(70, 45, generator=gen) * cluster_mask((70, 45), gen, block=8, p=0.3)
    b = torch.randn(70, generator=gen)
    x = torch.randn(33, 45, generator=gen)
    ref = torch.nn.functional.linear(x, w, b)
    with torch.no_grad():
        for k in KERNELS:
            assert float((make_linear(k, w, b)(x) - ref).abs().max()) <= TOL, k
            assert float((make_linear(k, w, None)(x) - (ref - b)).abs().max()) <= TOL, k
    panel = PanelLinear(w, b)
    assert sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in panel.spans) < w.numel()


# ------------------------------------------------------------------------------------------------ format
def test_files_are_json_and_safetensors_only(alexnet_export):
    # (choices.json: what a load timed, written by the loads of other tests)
    assert {p.name for p in alexnet_export.iterdir()} - {"choices.json"} == {"model.json", "model.safetensors"}
    spec = json.loads((alexnet_export / "model.json").read_text())
    assert spec["format"] == "dturbo-export" and spec["version"] == 3
    assert spec["input_norm"] == FMNIST_NORM
    assert spec["input_shape"] == [1, 28, 28] and spec["num_classes"] == 10
    raw = (alexnet_export / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])  # safetensors: a JSON header, then raw tensor bytes
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} <= {"F32", "I64"}
    with safe_open(str(alexnet_export / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {f"{n}.{p}" for n in ("conv1", "conv2", "conv3", "conv4", "dense1", "dense2",
                                                       "dense3") for p in ("weight", "bias")} | {
                                                           "conv2.bias_map", "conv4.bias_map"}
    for blob in (raw[:2], (alexnet_export / "model.json").read_bytes()[:2]):
        assert blob[:1] != b"\x80"  # no pickle protocol header


# ------------------------------------------------------------------------------------------------ errors
def test_export_errors_name_the_problem(alexnet_run, tmp_path):
    with pytest.raises(ex.ExportError, match="does not exist"):
        ex.export_run(tmp_path / "nope", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ex.ExportError, match="config.toml is missing"):
        ex.export_run(tmp_path / "empty", tmp_path / "o")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text((alexnet_run / "config.toml").read_text())
    with pytest.raises(ex.ExportError, match="model.safetensors is missing"):
        ex.export_run(run, tmp_path / "o")
    (run / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ex.ExportError, match="corrupt"):
        ex.export_run(run, tmp_path / "o")
    state = load_file(str(alexnet_run / "model.safetensors"))
    del state["dense2.weight_mu"]
    save_file(state, str(run / "model.safetensors"), metadata={"model": "alexnet-small"})
    with pytest.raises(ex.ExportError, match="dense2.weight_mu"):
        ex.export_run(run, tmp_path / "o")
    lenet = build_model("lenet5", SHAPE, 10).state_dict()
    save_file(dict(lenet), str(run / "model.safetensors"), metadata={"model": "alexnet-small"})
    with pytest.raises(ex.ExportError, match="shape"):
        ex.export_run(run, tmp_path / "o")
    save_file(dict(lenet), str(run / "model.safetensors"), metadata={"model": "lenet5"})
    with pytest.raises(ex.ExportError, match="config.toml says 'alexnet-small'"):
        ex.export_run(run, tmp_path / "o")
    bad = {k: v.clone() for k, v in load_file(str(alexnet_run / "model.safetensors")).items()}
    bad["conv2.weight_mu"][0, 0, 0, 0] = float("nan")
    save_file(bad, str(run / "model.safetensors"), metadata={"model": "alexnet-small"})
    with pytest.raises(ex.ExportError, match="NaN"):
        ex.export_run(run, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_unknown_layout_is_refused(monkeypatch):
    import dturbo.nn.models as models

    def odd(*args: object, **kw: object) -> torch.nn.Sequential:
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout())

    monkeypatch.setattr(models, "build_model", odd)
    with pytest.raises(ex.ExportError, match="unknown model layout.*Dropout"):
        ex.ops_from_state("mlp", {}, (4,), 2)
    with pytest.raises(ex.ExportError, match="unknown model layout"):
        monkeypatch.undo()
        ex.ops_from_state("resnet", {}, (1, 28, 28), 10)


def test_load_errors_name_the_problem(alexnet_export, tmp_path):
    with pytest.raises(ex.ExportError, match="does not exist"):
        ex.load(tmp_path / "nope")
    d = tmp_path / "m"
    d.mkdir()
    with pytest.raises(ex.ExportError, match="model.json is missing"):
        ex.load(d)
    (d / "model.json").write_text("{not json")
    with pytest.raises(ex.ExportError, match="not JSON"):
        ex.load(d)
    (d / "model.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ex.ExportError, match="not a dturbo export"):
        ex.load(d)
    spec = json.loads((alexnet_export / "model.json").read_text())
    (d / "model.json").write_text(json.dumps(spec))
    with pytest.raises(ex.ExportError, match="weights file .* is missing"):
        ex.load(d)
    (d / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(ex.ExportError, match="corrupt"):
        ex.load(d)
    tensors = load_file(str(alexnet_export / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "dense3.bias"}, str(d / "model.safetensors"))
    with pytest.raises(ex.ExportError, match="no tensor 'dense3.bias'"):
        ex.load(d)
    tensors["conv2.weight"] = tensors["conv2.weight"][:, :2].contiguous()
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ex.ExportError, match="conv2.weight' has shape"):
        ex.load(d)
    tensors = load_file(str(alexnet_export / "model.safetensors"))
    tensors["conv2.bias_map"] = tensors["conv2.bias_map"][:, :12].contiguous()
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ex.ExportError, match=r"bias_map' has shape \(16, 12, 13\), model.json says \(16, 13, 13\)"):
        ex.load(d)
    (d / "model.json").write_text(json.dumps({**spec, "version": 5}))
    with pytest.raises(ex.ExportError, match="format version 5; this dturbo reads 1, 2, 3, 4"):
        ex.load(d)
    spec["ops"][0]["type"] = "conv3d"
    (d / "model.json").write_text(json.dumps(spec))
    with pytest.raises(ex.ExportError, match="unknown or duplicate operation 'conv3d'"):
        ex.load(d)
    with pytest.raises(ValueError, match="kernels"):
        ex.load(alexnet_export, kernels="fast")
    with pytest.raises(ValueError, match="conv"):
        ex.load(alexnet_export, conv="winograd")


def test_cli_export(alexnet_run, tmp_path):
    result = CliRunner().invoke(app, ["export", str(alexnet_run), "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m" / "model.json").exists() and (tmp_path / "m" / "model.safetensors").exists()
    bad = CliRunner().invoke(app, ["export", str(tmp_path / "missing"), "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "does not exist" in " ".join(bad.output.split())


def test_mobilenet_exports_dense_through_group_norm(tmp_path):
    """Grouped convolutions and GroupNorm stop the compaction; the export still computes the same function."""
    model = build_model("mobilenet-v1", (3, 32, 32), 10, width=0.25, seed=7)
    s = {k: v.clone() for k, v in model.state_dict().items()}
    s["pw3.mask"][:4] = 0  # zero output channels before a GroupNorm: must stay
    s["dense1.mask"][:, :5] = 0
    cifar_norm = {"raw_dtype": "uint8", "scale": 255.0, "mean": [0.49, 0.48, 0.45], "std": [0.25, 0.24, 0.26]}
    cfg_run = write_run(tmp_path / "run", "mobilenet-v1", s, input_norm=cifar_norm, width=0.25)
    text = (cfg_run / "config.toml").read_text().replace('name = "fashion-mnist"', 'name = "cifar10"')
    (cfg_run / "config.toml").write_text(text)
    exported = ex.export_run(cfg_run, tmp_path / "model")
    assert exported.input_shape == (3, 32, 32)
    assert all(r["shape_before"] == r["shape_after"] for r in exported.layers)
    # NCHW as in the reference: a zero channel is constant, its one-channel GroupNorm divides rounding noise
    # by sqrt(eps), so another conv algorithm (channels_last) differs by more than TOL there.
    m = ex.load(tmp_path / "model", batch_size=8, compile=False, channels_last=False)
    model.load_state_dict(load_file(str(cfg_run / "model.safetensors")))
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    assert max_err(m, model.eval(), x) <= TOL


# ------------------------------------------------------------------------------------------------ pooling
@pytest.mark.parametrize("k,s", [(3, 2), (2, 2), (3, 1), ((3, 2), (2, 1))])
@pytest.mark.parametrize("channels_last", [False, True])
def test_separable_max_pool_equals_torch_bit_for_bit(k, s, channels_last):
    from dturbo.kernels import SeparableMaxPool2d, separable_supported

    gen = torch.Generator().manual_seed(11)
    for shape in ((5, 2, 28, 28), (3, 16, 13, 13), (2, 3, 7, 6)):
        x = torch.randn(shape, generator=gen)
        x[0, 0, :3, :3] = 1.0  # ties
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        ref = torch.nn.MaxPool2d(k, s)
        assert separable_supported(ref)
        assert torch.equal(SeparableMaxPool2d(k, s)(x), ref(x))
    assert not separable_supported(torch.nn.MaxPool2d(3, 2, padding=1))
    assert not separable_supported(torch.nn.MaxPool2d(3, 2, ceil_mode=True))


def test_pool_kernel_choice_is_recorded_and_exact(alexnet_run, alexnet_export):
    from dturbo.kernels import SeparableMaxPool2d

    ref = reference(alexnet_run, "alexnet-small")
    for pool in ("separable", "default", "auto"):
        m = ex.load(alexnet_export, batch_size=48, compile=False, pool=pool)
        assert set(m.pools) == {"pool1", "pool2", "pool4"}
        if pool != "auto":
            assert set(m.pools.values()) == {pool}
        assert all(isinstance(m.net.get_submodule(n), SeparableMaxPool2d) == (k == "separable")
                   for n, k in m.pools.items())
        x = random_images()
        with torch.no_grad():
            assert torch.equal(m(x).argmax(1), ref(x).argmax(1))
        assert max_err(m, ref, x) <= TOL
    with pytest.raises(ValueError, match="pool must be"):
        ex.load(alexnet_export, pool="avg")


@pytest.mark.skipif(not direct_supported(torch.nn.Conv2d(1, 6, 7, padding=3)), reason="no native kernels here")
def test_conv_blocks_fused_with_bias_map_activation_and_pooling_are_exact(alexnet_run, alexnet_export):
    from dturbo.export.runtime import _fuse_direct_blocks

    ref = reference(alexnet_run, "alexnet-small")
    m = ex.load(alexnet_export, batch_size=48, compile=False, channels_last=False, conv="default", pool="default")
    assert m.fused == {} and "fusion" not in m.info  # explicit kernels: nothing fused
    assert isinstance(m.net.conv2_bias_map, ex.BiasMap)  # conv1's constant channel 2, folded by export
    m.fuse("conv1", ["act1", "pool1"])
    m.fuse("conv2", ["conv2_bias_map", "act2", "pool2"])
    assert m.kernels["conv1"] == "direct" and m.pools["pool1"] == "fused" and m.fused == {
        "conv1": ["act1", "pool1"], "conv2": ["conv2_bias_map", "act2", "pool2"]}
    assert all(isinstance(getattr(m.net, n), torch.nn.Identity) for n in ("act1", "pool1", "conv2_bias_map", "act2"))
    assert max_err(m, ref, random_images()) <= TOL
    with pytest.raises(ValueError, match="fused with act1, pool1"):
        m.set_conv_kernels({"conv1": "default"})
    # The timed choice (auto), for every block the kernel can take: whichever wins, the choice is recorded and
    # the outputs are the model's.
    auto = ex.load(alexnet_export, batch_size=48, compile=False, channels_last=False, conv="default", pool="default")
    _fuse_direct_blocks(auto, random_images())
    info = auto.info["fusion"]
    assert {n: v["layers"] for n, v in info.items()} == {
        "conv1": ["act1", "pool1"], "conv2": ["conv2_bias_map", "act2", "pool2"], "conv3": ["act3"],
        "conv4": ["conv4_bias_map", "act4", "pool4"]}
    assert all(set(v["times_ms"]) == {"layers", "fused"} for v in info.values())
    assert auto.fused == {n: v["layers"] for n, v in info.items() if v["fused"]}
    assert max_err(auto, ref, random_images()) <= TOL


def test_a_load_keeps_its_timed_choices_for_the_next(alexnet_export, tmp_path):
    """A load that times every choice writes them to choices.json; the next load with the same machine, threads and
    batch size applies them without timing: the same kernels and the same outputs. A file that is not what a load
    writes, or that names other layers, means timing again."""
    import shutil

    from dturbo.export import choices

    model_dir = tmp_path / "alex"
    shutil.copytree(alexnet_export, model_dir)
    (model_dir / choices.FILE).unlink(missing_ok=True)  # what other tests' loads timed
    x = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    first = ex.load(model_dir, batch_size=16)
    assert "choices" not in first.info and (model_dir / choices.FILE).is_file()
    again = ex.load(model_dir, batch_size=16)
    assert "choices" in again.info
    assert (again.kernels, again.pools, again.fused, again.channels_last) == \
        (first.kernels, first.pools, first.fused, first.channels_last)
    with torch.no_grad():
        assert torch.equal(first(x), again(x))
    assert "choices" not in ex.load(model_dir, batch_size=8).info  # another batch size: timed
    stored = json.loads((model_dir / choices.FILE).read_text())
    assert len(stored) == 2
    at = next(iter(stored))
    for bad in ("{not json", json.dumps({at: {**stored[at], "linears": {"nope": "dense"}}}),
                json.dumps({at: {**stored[at], "convs": {k: "mystery" for k in stored[at]["convs"]} or {"c": "x"}}}),
                json.dumps([1, 2])):
        (model_dir / choices.FILE).write_text(bad)
        m = ex.load(model_dir, batch_size=16)
        assert "choices" not in m.info
        with torch.no_grad():
            torch.testing.assert_close(m(x), first(x))
    (model_dir / choices.FILE).unlink()
    model_dir.chmod(0o555)  # a folder that cannot be written: loads all the same
    try:
        assert "choices" not in ex.load(model_dir, batch_size=16).info
    finally:
        model_dir.chmod(0o755)

"""Export of any model (issue 14): ``dturbo.export.export_model`` on two bayesianized models that are not built into
dturbo (a residual CNN with BatchNorm and dropout; depthwise convolutions and a concatenation), loaded back in a fresh
process that has none of their code; compaction where the graph allows it; unknown ops; the built-in AlexNet through
both export paths; an Experiment's result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import dturbo
from dturbo import export as ex
from dturbo.export.graph import VOCABULARY
from dturbo.nn.models import build_model

TOL = 1e-4


class ResCNN(nn.Module):
    """conv-BN-relu into conv-BN-relu (a link compaction can use), a residual block (an add), dropout (module and
    function), pooling, a view by the batch size, two dense layers joined by a leaky relu (another link)."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 12, 3, padding=1, bias=False), nn.BatchNorm2d(12)
        self.conv3, self.bn3 = nn.Conv2d(12, 12, 3, padding=1, bias=False), nn.BatchNorm2d(12)
        self.drop = nn.Dropout(0.3)
        self.fc1 = nn.Linear(12 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = F.relu(h + self.bn3(self.conv3(h)))
        h = F.adaptive_avg_pool2d(F.max_pool2d(h, 2), 4)
        h = F.dropout(self.drop(h.view(h.size(0), -1)), 0.1, self.training)
        return self.fc2(F.leaky_relu(self.fc1(h), 0.1))


class DepthwiseCat(nn.Module):
    """A stem, a depthwise 3x3 convolution (groups = channels) with BatchNorm, its output concatenated with the stem's,
    a pointwise convolution gating the concatenation, a spatial mean and a dense head (linear, GELU, linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.bn = nn.BatchNorm2d(8)
        self.pw = nn.Conv2d(16, 16, 1)
        self.head = nn.Sequential(nn.Linear(16, 10), nn.GELU(), nn.Linear(10, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.relu6(self.stem(x))
        h = torch.cat([s, F.silu(self.bn(self.dw(s)))], dim=1)
        h = torch.sigmoid(self.pw(h)) * h
        return self.head(h.mean((2, 3)))


SHAPES = {"res": (1, 16, 16), "dw": (3, 12, 12)}


def randomise(model: nn.Module, gen: torch.Generator) -> None:
    """BatchNorm statistics and affine parameters away from identity; random biases; 30% random zeros in every mask."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5, generator=gen)
                m.running_var.uniform_(0.5, 2.0, generator=gen)
                m.weight.uniform_(0.5, 1.5, generator=gen)
                m.bias.uniform_(-0.5, 0.5, generator=gen)
            if isinstance(m, dturbo.nn.BayesianLayer):
                m.mask.copy_((torch.rand(m.mask.shape, generator=gen) > 0.3).float())
                if m.bias is not None:
                    m.bias.uniform_(-0.3, 0.3, generator=gen)


def res_model() -> nn.Module:
    gen = torch.Generator().manual_seed(1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = dturbo.bayesianize(ResCNN())
    randomise(model, gen)
    with torch.no_grad():
        model.conv1.mask[2] = 0  # a whole channel: constant after the folded BN, folded into conv2's bias map
        model.conv1.mask[5] = 0
        model.conv2.mask[:, 6] = 0  # conv1 channel 6 unused by conv2: removed
        model.conv2.mask[7] = 0  # feeds the residual add: stays (masked dense)
        model.conv3.mask[3] = 0  # its output is added: stays
        model.fc1.mask[4:8] = 0  # rows: leaky_relu(bias) folded into fc2's bias
        model.fc2.mask.fill_(1)  # every fc1 unit used: only those rows go
    return model.eval()


def dw_model() -> nn.Module:
    gen = torch.Generator().manual_seed(2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = dturbo.bayesianize(DepthwiseCat())
    randomise(model, gen)
    with torch.no_grad():
        model.stem.mask[1] = 0  # used by the depthwise conv and the concatenation: stays
        model.dw.mask[3] = 0  # a depthwise channel
        model.pw.mask[5] = 0
        model.head[0].mask[2] = 0  # a row before GELU: gelu(bias) folded into head[2]'s bias
        model.head[2].mask.fill_(1)
    return model.eval()


def inputs(shape: tuple[int, ...], n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[nn.Module, Path]]:
    out = {}
    for key, make in (("res", res_model), ("dw", dw_model)):
        model, d = make(), tmp_path_factory.mktemp("exp") / key
        ex.export_model(model, d, example_input=inputs(SHAPES[key], 2, 0))
        out[key] = (model, d)
    return out


LOADER = """
import sys
import torch
from safetensors.torch import load_file, save_file
from dturbo.export import load

for d in sys.argv[1:]:
    x = load_file(d + "/inputs.safetensors")
    model = load(d, batch_size=4, compile=False)
    assert not model.training
    with torch.no_grad():
        save_file({k: model(v).contiguous() for k, v in x.items()}, d + "/outputs.safetensors")
print(sorted(m for m in sys.modules if m.startswith("test")))
"""


@pytest.mark.slow
def test_loads_in_a_fresh_process_without_the_models_code(exported):
    """One sample and a batch of 7 (the example had 2) give the model's outputs within 1e-4, in a process that has
    neither the test module nor the model classes."""
    dirs = []
    for key, (_, d) in exported.items():
        x = {"one": inputs(SHAPES[key], 1, 3), "batch": inputs(SHAPES[key], 7, 4) * 2}
        save_file(x, str(d / "inputs.safetensors"))
        dirs.append(str(d))
    env = {**os.environ, "PYTHONPATH": str(Path(dturbo.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", LOADER, *dirs], capture_output=True, text=True, env=env, timeout=300,
                          cwd=str(Path(dirs[0]).parent))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"  # no test module imported there
    for key, (model, d) in exported.items():
        got = load_file(str(d / "outputs.safetensors"))
        x = load_file(str(d / "inputs.safetensors"))
        for k in ("one", "batch"):
            with torch.no_grad():
                want = model(x[k])
            assert got[k].shape == want.shape
            assert float((got[k] - want).abs().max()) <= TOL, (key, k)


def test_compaction_where_the_graph_allows_it(exported):
    spec = json.loads((exported["res"][1] / "model.json").read_text())
    assert spec["version"] == ex.GRAPH_VERSION and spec["kind"] == "graph"
    layers = {r["name"]: r for r in spec["layers"]}
    assert layers["conv1"]["shape_after"] == [5, 1, 3, 3]  # channels 2, 5 (zero weights) and 6 (unused) removed
    assert layers["conv2"]["shape_after"] == [12, 5, 3, 3]  # its outputs feed the residual add: all kept
    assert layers["conv3"]["shape_after"] == [12, 12, 3, 3]
    assert layers["fc1"]["shape_after"] == [28, 192] and layers["fc2"]["shape_after"] == [5, 28]
    ops = {o["name"]: o for o in spec["ops"]}
    assert ops["conv2"]["attrs"]["bias_map"] and not ops["conv1"]["attrs"]["bias_map"]
    assert not any(o["type"] in ("batch_norm", "dropout") for o in spec["ops"])  # folded, removed
    dw = {r["name"]: r for r in json.loads((exported["dw"][1] / "model.json").read_text())["layers"]}
    assert dw["stem"]["shape_after"] == [8, 3, 3, 3] and dw["dw"]["shape_after"] == [8, 1, 3, 3]  # used twice; grouped
    assert dw["head_0"]["shape_after"] == [9, 16] and dw["head_2"]["shape_after"] == [4, 9]


def test_no_compaction_is_the_masked_dense_model(tmp_path):
    model = res_model()
    e = ex.export_model(model, tmp_path / "m", example_input=inputs(SHAPES["res"], 2, 0), compaction=False)
    assert all(r["shape_after"] == r["shape_before"] for r in e.layers)
    loaded = ex.load(tmp_path / "m", kernels="dense", channels_last=False, compile=False, conv="default",
                     pool="default")
    x = inputs(SHAPES["res"], 5, 9)
    with torch.no_grad():
        assert float((loaded(x) - model(x)).abs().max()) <= TOL


def test_files_are_json_and_safetensors_only(exported):
    d = exported["dw"][1]
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("model")) == ["model.json", "model.safetensors"]
    spec = json.loads((d / "model.json").read_text())
    tensors = load_file(str(d / "model.safetensors"))
    assert {"stem.weight", "dw.weight", "pw.weight", "head_0.weight"} <= set(tensors)
    assert {o["type"] for o in spec["ops"]} <= {*VOCABULARY, "input", "output"}
    assert (d / "model.safetensors").read_bytes()[:1] != b"\x80"  # no pickle protocol header


def test_unknown_ops_and_untraceable_models_are_named():
    class Cumsum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.cumsum(x, 1))

    class Upsampling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.up = nn.Conv2d(1, 2, 3), nn.Upsample(scale_factor=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.up(self.conv(x)).flatten(1)

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if x.sum() > 0 else -self.fc(x)

    with pytest.raises(ex.ExportError, match=r"node 'cumsum' calls function torch.*cumsum, which export does not know"):
        ex.export_model(dturbo.bayesianize(Cumsum()), example_input=torch.randn(2, 4))
    with pytest.raises(ex.ExportError, match=r"node 'up' calls module 'up' of type torch.nn.*Upsample"):
        ex.export_model(dturbo.bayesianize(Upsampling()), example_input=torch.randn(2, 1, 6, 6))
    with pytest.raises(ex.ExportError, match="cannot capture the graph of Branchy with torch.fx"):
        ex.export_model(dturbo.bayesianize(Branchy()), example_input=torch.randn(2, 4))


def test_random_in_eval_mode_is_refused():
    class AlwaysDrop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(F.dropout(x, 0.5))  # training=True: random also in eval mode

    with pytest.raises(ex.ExportError, match="node 'dropout'.*training=self.training"):
        ex.export_model(AlwaysDrop(), example_input=torch.randn(2, 4))


def test_builtin_alexnet_same_as_the_built_in_export(tmp_path):
    """alexnet-small through export_model: the same compacted shapes and outputs as through export_state."""
    gen = torch.Generator().manual_seed(0)
    model = build_model("alexnet-small", (1, 28, 28), 10, seed=1)
    with torch.no_grad():
        for _, m in dturbo.nn.bayesian_layers(model):
            m.mask.copy_((torch.rand(m.mask.shape, generator=gen) > 0.2).float())
            m.bias.uniform_(-0.3, 0.3, generator=gen)
        model.conv1.mask[2] = 0
        model.conv2.mask[:, 1] = 0
        model.conv3.mask[7] = 0
        model.conv4.mask[10:20] = 0
        model.dense1.mask[0:20] = 0
    model.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    builtin = ex.export_state("alexnet-small", state, (1, 28, 28))
    ex.save(builtin, tmp_path / "builtin")
    graph = ex.export_model(model, tmp_path / "graph", example_input=inputs((1, 28, 28), 2, 0))
    assert [(r["name"], r["shape_after"]) for r in graph.layers] == [(r["name"], r["shape_after"])
                                                                      for r in builtin.layers]
    assert graph.layers[0]["shape_after"][0] < 6  # something was removed
    kw = {"kernels": "dense", "channels_last": False, "compile": False, "conv": "default", "pool": "default"}
    a, b = ex.load(tmp_path / "builtin", **kw), ex.load(tmp_path / "graph", **kw)
    assert json.loads((tmp_path / "builtin" / "model.json").read_text())["version"] == ex.VERSION
    x = inputs((1, 28, 28), 6, 8)
    with torch.no_grad():
        assert float((a(x) - b(x)).abs().max()) <= TOL
        assert float((b(x) - model(x)).abs().max()) <= TOL


def images(n: int = 120) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, size=(n, 16, 16), dtype=np.uint8)
    y = rng.integers(0, 4, size=n).astype(np.int64)
    return x[:90], y[:90], x[90:], y[90:]


@pytest.mark.filterwarnings("ignore::dturbo.sim.ScheduleWarning")
def test_an_experiment_result_exports_and_the_run_directory_says_how(tmp_path):
    config = {
        "experiment": {"name": "export", "seed": 0, "rounds": 1, "threads": 1},
        "data": {"name": "arrays"}, "federation": {"clients": 2, "partition": "iid"},
        "train": {"local_steps": 2, "batch_size": 16, "lr": 0.01},
        "dturbo": {"sparsity": {"target_density": 0.5, "warmup_rounds": 0, "ramp_rounds": 1}},
    }
    data = images()
    result = dturbo.Experiment(config, data=data, model=lambda: ResCNN(classes=4), out=tmp_path / "run",
                               progress=False, figures=False).run()
    result.export(tmp_path / "m")
    ds = dturbo.data.dataset_from_arrays(*data)
    x = torch.from_numpy(ds.x_test)
    with torch.no_grad():
        want = result.model(x)
        normalised = ex.load(tmp_path / "m", compile=False)(x)
        raw = ex.load(tmp_path / "m", compile=False, inputs="raw")(torch.from_numpy(data[2]))
    assert float((normalised - want).abs().max()) <= TOL and float((raw - want).abs().max()) <= TOL
    with pytest.raises(ex.ExportError, match=r"model of one's own.*result.export\(OUT\).*export_model"):
        ex.export_run(tmp_path / "run")

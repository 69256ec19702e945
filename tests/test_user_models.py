"""Models of one's own (issue 14): dturbo.bayesianize and dturbo.Experiment(model=...), with two networks that are not
built into dturbo: a residual CNN with BatchNorm (and dropout), and one with a depthwise convolution and a
concatenation."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import load_file
from torch import nn

import dturbo
from dturbo.algorithms.base import message_bits
from dturbo.algorithms.dturbo.sparsity import SETTLED_SHORTFALL
from dturbo.algorithms.plain import PlainState
from dturbo.checkpoint import CheckpointError
from dturbo.nn import BayesConv2d, BayesianizeError, BayesLinear, UnsupportedLayerError, bayesian_layers
from dturbo.nn.convert import user_model_factory
from dturbo.nn.models import ModelInputError, ModelOutputError
from dturbo.nn.shapes import grid_shape
from dturbo.settings import load_config
from dturbo.testing import Residual

TIMING = {"seconds", "server_seconds"}
CLASSES = 4


class ResNetTiny(nn.Module):
    """conv + BN stem, one residual block (an add), dropout, a dense head."""

    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = Residual(8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8 * 6 * 6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.flatten(F.max_pool2d(self.block(self.stem(x)), 2), 1)))


class DepthwiseNet(nn.Module):
    """A depthwise 3x3 convolution (groups = channels), its output concatenated with its input, a pointwise 1x1."""

    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8)
        self.pw = nn.Conv2d(16, 16, 1)
        self.head = nn.Linear(16 * 3 * 3, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.relu(self.stem(x))
        h = F.relu(self.pw(torch.cat([F.relu(self.dw(s)), s], 1)))
        return self.head(torch.flatten(F.avg_pool2d(h, 4), 1))


MODELS = {"residual_bn": ResNetTiny, "depthwise": DepthwiseNet}


def images(n: int = 300) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """1x12x12 uint8 images of 4 classes: the class's quadrant is brighter. 240 to train, 60 to test."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 120, size=(n, 12, 12), dtype=np.uint8)
    y = rng.integers(0, CLASSES, size=n).astype(np.int64)
    for q in range(CLASSES):
        r, c = 6 * (q // 2), 6 * (q % 2)
        x[y == q, r : r + 6, c : c + 6] += 100
    return x[:240], y[:240], x[240:], y[240:]


def config(algorithm: str = "dturbo", rounds: int = 3, **sections: dict) -> dict:
    cfg: dict = {
        "experiment": {"name": "user", "seed": 0, "rounds": rounds, "threads": 1, "algorithm": algorithm},
        "data": {"name": "arrays"},
        "federation": {"clients": 3, "partition": "iid"},
        "train": {"local_steps": 3, "batch_size": 16, "lr": 0.01},
        "dturbo": {"sparsity": {"target_density": 0.4, "warmup_rounds": 0, "ramp_rounds": 2}},
    }
    for name, keys in sections.items():
        cfg[name] = {**cfg.get(name, {}), **keys}
    return cfg


def run(out: Path, model: object, algorithm: str = "dturbo", rounds: int = 3, resume: bool = False,
        **sections: dict) -> dturbo.ExperimentResult:
    return dturbo.Experiment(config(algorithm, rounds, **sections), data=images(), model=model, out=out,
                             resume=resume, progress=False, figures=False).run()


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


def server_state(run_dir: Path) -> dict[str, np.ndarray]:
    return load_file(str(run_dir / "checkpoint" / "state.safetensors"))


# ------------------------------------------------------------------------------------------------ bayesianize
class Geometry(nn.Module):
    """Conv2d's options: a non-square kernel and stride, dilation, reflect padding, groups 2, no bias."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 4, (3, 5), stride=(2, 1), padding=(1, 2), padding_mode="reflect")
        self.b = nn.Conv2d(4, 6, 3, dilation=2, padding="same", groups=2, bias=False)
        self.fc = nn.Linear(6 * 6 * 12, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.b(self.a(x)), 1))


@pytest.mark.parametrize("make", [ResNetTiny, DepthwiseNet, Geometry], ids=["residual_bn", "depthwise", "geometry"])
def test_bayesianize_keeps_the_function_and_grids_the_gemm(make):
    torch.manual_seed(1)
    net = make().eval()
    x = torch.randn(5, 1, 12, 12)
    with torch.no_grad():
        before = net(x)
    plain_layers = {n: m for n, m in net.named_modules() if type(m) in (nn.Linear, nn.Conv2d)}
    out = dturbo.bayesianize(net, example_input=x)
    assert out is net and out.input_shape == (1, 12, 12)
    layers = dict(bayesian_layers(out))
    assert sorted(layers) == sorted(plain_layers) and not any(type(m) in (nn.Linear, nn.Conv2d) for m in out.modules())
    for name, old in plain_layers.items():
        new = layers[name]
        assert isinstance(new, BayesLinear if isinstance(old, nn.Linear) else BayesConv2d)
        w = old.weight
        assert grid_shape(new) == (w.shape[0], int(np.prod(w.shape[1:])))  # SPEC §2: (out, in/groups * kh * kw)
        torch.testing.assert_close(new.weight_mu, w, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(out(x), before, rtol=0, atol=1e-6)  # eval: the mean weights, the same network
    if make is DepthwiseNet:
        assert grid_shape(layers["dw"]) == (8, 9)
    # each layer's sigma starts at sigma_init_ratio times its weight std, sampled in training mode
    out.train()
    with torch.no_grad():
        assert not torch.equal(out(x), out(x))


def test_bayesianize_leaves_the_rng_alone_and_a_shared_layer_shared():
    shared = nn.Linear(4, 4)
    net = nn.Sequential(shared, nn.ReLU(), shared)
    state = torch.random.get_rng_state()
    dturbo.bayesianize(net)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert net[0] is net[2] and isinstance(net[0], BayesLinear) and len(bayesian_layers(net)) == 1
    # the root itself
    assert isinstance(dturbo.bayesianize(nn.Conv2d(1, 2, 3), input_shape=(1, 5, 5)), BayesConv2d)
    # seed: the weights drawn again, the same for the same seed
    a, b = (dturbo.bayesianize(nn.Linear(3, 2), seed=5) for _ in range(2))
    torch.testing.assert_close(a.weight_mu, b.weight_mu, rtol=0, atol=0)


def test_bayesianize_refuses_what_it_cannot_grid():
    with pytest.raises(BayesianizeError, match="no nn.Linear or nn.Conv1d/2d/3d"):
        dturbo.bayesianize(nn.Sequential(nn.BatchNorm2d(3), nn.ReLU()))
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sequential(nn.ConvTranspose1d(2, 2, 3), nn.ConvTranspose2d(2, 2, 3)))
    with pytest.raises(UnsupportedLayerError, match=r"1\.0 \(ConvTranspose1d\), 1\.1 \(ConvTranspose2d\)"):
        dturbo.bayesianize(net)
    assert type(net[0]) is nn.Conv2d  # nothing was replaced
    with pytest.raises(UnsupportedLayerError, match="LazyLinear"):
        dturbo.bayesianize(nn.Sequential(nn.LazyLinear(3)))
    with pytest.raises(BayesianizeError, match="sigma_mode"):
        dturbo.bayesianize(nn.Linear(2, 2), sigma_mode="row")


def test_a_factory_gives_the_same_model_every_call():
    module = ResNetTiny()
    state = torch.random.get_rng_state()
    kw = {"sigma_mode": "layer", "sigma_init_ratio": 0.1, "seed": 3, "input_shape": (1, 12, 12)}
    for source in (ResNetTiny, module):  # a function (seeded) and a module (copied)
        make = user_model_factory(source, **kw)
        a, b = make(), make()
        assert a is not b and a.input_shape == (1, 12, 12)
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert ka == kb and torch.equal(va, vb)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_plain_state_is_averaged_by_samples():
    net = dturbo.bayesianize(ResNetTiny())
    plain = PlainState(net)
    keys = {t.key for t in plain.tensors}
    assert "stem.1.running_mean" in keys and "block.bn2.weight" in keys
    assert "stem.1.num_batches_tracked" in plain.fixed and not any(k.startswith("head.") for k in keys)
    f = plain.tensors[0].field
    decoded = [{t.field: np.full(t.shape, v) for t in plain.tensors} for v in (1.0, 5.0)]
    np.testing.assert_allclose(plain.aggregate([1, 3], decoded)[f], 4.0)
    assert not PlainState(dturbo.bayesianize(DepthwiseNet()))  # no state outside its Bayesian layers


# ------------------------------------------------------------------------------------------------- federation
@pytest.mark.filterwarnings("ignore::dturbo.sim.ScheduleWarning")  # the cut runs end before the ramp does
@pytest.mark.parametrize("name", list(MODELS))
def test_dturbo_federates_sparsifies_and_resumes(tmp_path, name):
    make = MODELS[name]
    whole = run(tmp_path / "whole", make)
    last = whole.metrics[-1]
    # At most the target; under it by at most the settled shortfall (docs/sparsity.md §2) and the weights whose mean
    # rounds to 0 in float16
    assert last["scheduled_density"] == 0.4 and 0.4 * (1 - SETTLED_SHORTFALL) - 2e-3 <= last["density"] <= 0.4
    assert all(np.isfinite(r["loss"]) for r in whole.metrics)
    assert isinstance(dict(bayesian_layers(whole.model))["head"], BayesLinear)
    # cut after round 1 and after round 2, then resume: the same rows, state and model as the whole run
    states = []
    for rounds in (1, 2, 3):
        res = run(tmp_path / "split", make, rounds=rounds, resume=rounds > 1)
        states.append(server_state(tmp_path / "split"))
    assert rows(tmp_path / "split") == rows(tmp_path / "whole")
    final = server_state(tmp_path / "whole")
    assert states[-1].keys() == final.keys() and all(np.array_equal(states[-1][k], final[k]) for k in final)
    for k, v in whole.model.state_dict().items():
        assert torch.equal(v, res.model.state_dict()[k]), k
    if name == "residual_bn":
        # BatchNorm's statistics and affine weights travel: the server's state moves round after round, and the
        # global model carries it
        key = "block.bn1.running_mean.plain"
        assert not np.array_equal(states[0][key], np.zeros(8)) and not np.array_equal(states[0][key], states[1][key])
        assert not np.array_equal(states[0]["stem.1.weight.plain"], states[1]["stem.1.weight.plain"])
        torch.testing.assert_close(whole.model.block.bn1.running_mean, torch.from_numpy(final[key]), rtol=0, atol=0)


def _plain_numel(make: type[nn.Module]) -> int:
    return sum(t.size for t in PlainState(dturbo.bayesianize(make())).tensors)


@pytest.mark.parametrize("name", list(MODELS))
def test_fedavg_federates_and_counts_the_other_state(tmp_path, name):
    make = MODELS[name]
    # the training messages alone (a BatchNorm model's calibration: tests/test_batchnorm.py)
    res = run(tmp_path / "run", make, algorithm="fedavg", rounds=2, fedavg={"dtype": "float32"},
              federation={"batchnorm": "averaged"})
    net = dturbo.bayesianize(make())
    weights = sum(p.numel() for _, la in bayesian_layers(net) for p in (la.weight_mu, la.bias) if p is not None)
    # the ledger's values: every weight and bias at 32 bits, the other state at 16, to each of 3 clients and back
    per_message = 32 * weights + 16 * _plain_numel(make)
    for row in res.metrics:
        assert row["down_values_bits"] == row["up_values_bits"] == 3 * per_message
    assert res.density == 1.0 and all(np.isfinite(r["loss"]) for r in res.metrics)
    if name == "residual_bn":
        state = server_state(tmp_path / "run")
        assert not np.array_equal(state["stem.1.running_var.plain"], np.ones(8))


@pytest.mark.parametrize("algorithm", ["fedpaq", "dssm", "stc", "fedpm"])
def test_every_baseline_carries_batchnorm(tmp_path, algorithm):
    res = run(tmp_path / "run", ResNetTiny, algorithm=algorithm, rounds=2)
    state = server_state(tmp_path / "run")
    assert not np.array_equal(state["block.bn2.running_mean.plain"], np.zeros(8))
    torch.testing.assert_close(res.model.block.bn2.running_mean,
                               torch.from_numpy(state["block.bn2.running_mean.plain"]), rtol=0, atol=0)
    assert all(r["clients_ok"] == 3 for r in res.metrics)


def test_the_other_state_is_in_the_ledger_of_dturbo(tmp_path):
    """A downlink's values grow by exactly 16 bits per value of the other state."""
    from dturbo.sim import Simulator

    sims = {}
    for name, make in (("bn", ResNetTiny), ("no_bn", lambda: _without_bn(ResNetTiny()))):
        exp = dturbo.Experiment(config(), data=images(), model=make, out=tmp_path / name, progress=False)
        sims[name] = Simulator(exp.config, exp.out, dataset=exp.dataset, model=exp._model_factory)
    bits = {n: message_bits(s.server.downlink(s.server.init(), 0), s.server.layouts) for n, s in sims.items()}
    assert bits["bn"]["values"] - bits["no_bn"]["values"] == 16 * _plain_numel(ResNetTiny)


@pytest.mark.filterwarnings("ignore::dturbo.sim.ScheduleWarning")
def test_every_value_is_accounted_for_and_the_dense_modules_are_named(tmp_path):
    """density covers the supports' weights; density_all every value of the model, counting what travels dense
    (biases, BatchNorm) as nonzero; dense_share that share; one warning names the dense modules with their counts."""
    from dturbo.algorithms.plain import DenseStateWarning

    with pytest.warns(DenseStateWarning) as caught:
        res = run(tmp_path / "run", ResNetTiny, rounds=2)
    [text] = [str(w.message) for w in caught if w.category is DenseStateWarning]  # once
    net = dturbo.bayesianize(ResNetTiny())
    plain = PlainState(net)
    assert plain.by_module() == {"stem.1": 32, "block.bn1": 32, "block.bn2": 32}  # weight, bias, mean, var of 8
    assert "stem.1 32, block.bn1 32, block.bn2 32 values" in text
    weights = sum(la.weight_mu.numel() for _, la in bayesian_layers(net))
    dense = 96 + net.head.bias.numel()
    assert f"{dense:,} of the model's {weights + dense:,} values" in text
    state = server_state(tmp_path / "run")
    kept = sum(int(np.count_nonzero(state[f"{name}.mu"])) for name, _ in bayesian_layers(net))
    last = res.metrics[-1]
    assert last["dense_share"] == pytest.approx(dense / (weights + dense))
    assert last["density_all"] == pytest.approx((last["density"] * weights + dense) / (weights + dense))
    assert last["density"] < last["density_all"] < 1 and kept <= last["density"] * weights + 1e-9
    # a model whose state is all in Bayesian layers: no warning, biases still counted
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DenseStateWarning)
        res = run(tmp_path / "dw", DepthwiseNet, rounds=1)
    assert 0 < res.metrics[-1]["dense_share"] < 0.1


def test_resume_refuses_other_data_naming_what_changed(tmp_path):
    run(tmp_path / "run", DepthwiseNet, rounds=1)
    before = (tmp_path / "run" / "checkpoint" / "state.safetensors").read_bytes()
    x_train, y_train, x_test, y_test = images()
    for data, what in [((x_train, np.roll(y_train, 1), x_test, y_test), r"y_train: the same dtype and shape, other"),
                       ((x_train[:200], y_train[:200], x_test, y_test), r"x_train: float32 \[240, 1, 12, 12\] -> "
                                                                         r"float32 \[200, 1, 12, 12\]")]:
        with pytest.raises(CheckpointError, match=what):
            dturbo.Experiment(config(rounds=2), data=data, model=DepthwiseNet, out=tmp_path / "run", resume=True,
                              progress=False, figures=False).run()
    assert (tmp_path / "run" / "checkpoint" / "state.safetensors").read_bytes() == before
    res = dturbo.Experiment(config(rounds=2), data=images(), model=DepthwiseNet, out=tmp_path / "run", resume=True,
                            progress=False, figures=False).run()
    assert len(res.metrics) == 2


def _without_bn(net: nn.Module) -> nn.Module:
    for parent in net.modules():
        for key, child in list(parent._modules.items()):
            if isinstance(child, nn.BatchNorm2d):
                setattr(parent, key, nn.Identity())
    return net


# ------------------------------------------------------------------------------------------------- bad input
def test_bad_models_are_refused_at_construction(tmp_path):
    with pytest.raises(ModelOutputError, match=r"7 output values per sample.*4 classes"):
        dturbo.Experiment(config(), data=images(), model=lambda: ResNetTiny(classes=7), out=tmp_path / "a")
    with pytest.raises(UnsupportedLayerError, match=r"conv \(ConvTranspose1d\)"):
        dturbo.Experiment(config(), data=images(), model=nn.Sequential(dict_conv1d()), out=tmp_path / "b")
    with pytest.raises(BayesianizeError, match="has no nn.Linear or nn.Conv1d/2d/3d"):
        dturbo.Experiment(config(), data=images(), model=nn.Sequential(nn.Flatten()), out=tmp_path / "c")
    with pytest.raises(BayesianizeError, match="not a torch.nn.Module"):
        dturbo.Experiment(config(), data=images(), model=lambda: 3, out=tmp_path / "d")
    with pytest.raises(dturbo.ConfigError, match="'custom' needs the model"):
        dturbo.Experiment(config() | {"model": {"name": "custom"}}, data=images(), out=tmp_path / "e")
    # the method's settings against the model, before any round: a layer it does not have, a target over budget
    bad = load_config(config(), {"dturbo.sparsity.layer_targets": {"conv9": 0.5}})
    with pytest.raises(dturbo.ConfigError, match="'conv9', which the model does not have"):
        dturbo.Experiment(bad, data=images(), model=ResNetTiny, out=tmp_path / "f")
    over = load_config(config(), {"dturbo.sparsity.layer_targets": {"first": 1.0, "last": 1.0},
                                  "dturbo.sparsity.target_density": 0.01, "data.name": "fashion-mnist"})
    with pytest.raises(dturbo.ConfigError, match="leaves the other layers a density of"):
        dturbo.Experiment(over, out=tmp_path / "g")  # the built-in model on Fashion-MNIST: no data read
    assert not any(tmp_path.iterdir())  # nothing written


def dict_conv1d() -> nn.Module:
    from collections import OrderedDict

    return nn.Sequential(OrderedDict(conv=nn.ConvTranspose1d(1, 2, 3), flat=nn.Flatten()))


@pytest.mark.filterwarnings("ignore::dturbo.sim.ScheduleWarning")
def test_a_custom_run_draws_figures_and_export_says_why_not(tmp_path):
    from dturbo.export import ExportError, export_run

    dturbo.Experiment(config(rounds=1, dturbo={"sparsity": {"warmup_rounds": 1}}), data=images(), model=DepthwiseNet,
                      out=tmp_path / "run", progress=False).run()
    assert (tmp_path / "run" / "figures" / "curves.png").exists()
    with pytest.raises(ExportError, match="model of one's own"):
        export_run(tmp_path / "run")


def test_bayesianize_refuses_tied_weights_instead_of_untying_them():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    net = Tied()
    with pytest.raises(BayesianizeError, match=r"weight tying\): a\.weight = b\.weight"):
        dturbo.bayesianize(net)
    assert type(net.a) is nn.Linear and net.b.weight is net.a.weight  # nothing replaced, still tied

    class Embedded(nn.Module):  # a language model's tie: the embedding stays dense, the output would not
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight

    with pytest.raises(BayesianizeError, match=r"emb\.weight = out\.weight"):
        dturbo.bayesianize(Embedded())


def test_token_ids_are_never_standardised_and_an_embedding_model_runs(tmp_path):
    from dturbo.data import dataset_from_arrays

    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(200, 8)).astype(np.int64)
    y = (x[:, 0] % 4).astype(np.int64)
    ds = dataset_from_arrays(x[:150], y[:150], x[150:], y[150:])
    assert ds.x_train.dtype == np.int64 and set(np.unique(ds.x_train)) <= set(range(50))
    assert ds.input_dtype == torch.int64 and ds.input_norm is None
    np.testing.assert_array_equal(np.sort(np.unique(ds.x_train)), np.sort(np.unique(x[:150])))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.fc = nn.Embedding(50, 8), nn.Linear(64, 4)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.fc(self.emb(t).flatten(1))

    cfg = dturbo.load_config(preset="quick", overrides={
        "experiment.rounds": 2, "federation.clients": 2, "train.local_steps": 12,
        "dturbo.sparsity.warmup_rounds": 0, "dturbo.sparsity.ramp_rounds": 1})
    result = dturbo.Experiment(cfg, data=(x[:150], y[:150], x[150:], y[150:]), model=Net(), out=tmp_path / "run",
                               figures=False, progress=False).run()
    assert 0 <= result.accuracy <= 1 and len(result.metrics) == 2


def test_standardize_false_keeps_the_inputs_as_given():
    from dturbo.data import dataset_from_arrays

    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(100, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=100)
    kept = dataset_from_arrays(x[:80], y[:80], x[80:], y[80:], standardize=False)
    np.testing.assert_array_equal(kept.x_train, x[:80])
    scaled = dataset_from_arrays(x[:80], y[:80], x[80:], y[80:])
    assert abs(float(scaled.x_train.mean())) < 1e-5  # the default standardises
    pixels = rng.integers(0, 256, size=(20, 1, 4, 4)).astype(np.uint8)
    raw = dataset_from_arrays(pixels[:15], y[:15], pixels[15:], y[15:20], standardize=False)
    np.testing.assert_allclose(raw.x_train, pixels[:15] / 255.0, rtol=1e-6)


@pytest.mark.parametrize("conv, shape", [(nn.Conv1d, (3, 40)), (nn.Conv3d, (2, 5, 6, 6))], ids=["conv1d", "conv3d"])
def test_conv1d_and_conv3d_become_bayesian_with_gemm_grids_and_federate(tmp_path, conv, shape):
    """A sequence model (Conv1d) and a volume model (Conv3d): the same function after bayesianize, the grid is the
    GEMM's (out x in/groups * prod(kernel)), a tied-row prior keeps whole channels, and a short run federates."""
    torch.manual_seed(0)
    c = shape[0]
    net = nn.Sequential(conv(c, 6, 3, padding=1, padding_mode="reflect"), nn.ReLU(), conv(6, 4, 3, groups=2),
                        nn.Flatten(), nn.LazyLinear(CLASSES))
    x = torch.randn(8, *shape)
    net(x)  # materialise the lazy head
    net[4] = nn.Linear(net[4].in_features, CLASSES)
    want = net.eval()(x)
    bayes = dturbo.bayesianize(copy_of(net))
    layers = bayesian_layers(bayes)
    assert [type(m).__name__ for _, m in layers] == [f"BayesConv{len(shape) - 1}d"] * 2 + ["BayesLinear"]
    torch.testing.assert_close(bayes.eval()(x), want, rtol=1e-5, atol=1e-6)
    k = 3 ** (len(shape) - 1)
    assert grid_shape(layers[0][1]) == (6, c * k) and grid_shape(layers[1][1]) == (4, 3 * k)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(240, *shape)).astype(np.float32)
    ys = (xs.reshape(240, -1)[:, :4].sum(1) > 0).astype(np.int64) * 2 + (xs.reshape(240, -1)[:, 5] > 0)
    cfg = config(rounds=2, dturbo={"sparsity": {"target_density": 0.5, "warmup_rounds": 0, "ramp_rounds": 1},
                                   "prior": {"conv": {"tie_rows": True}}}, data={"layout": "channels_first"})
    result = dturbo.Experiment(cfg, data=(xs[:200], ys[:200], xs[200:], ys[200:]), model=copy_of(net),
                               out=tmp_path / "run", figures=False, progress=False).run()
    assert 0 < result.density < 1
    for _, layer in bayesian_layers(result.model):
        if layer.weight_mu.dim() >= 3:  # whole output channels kept or removed
            rows = (layer.weight_mu * layer.mask).reshape(layer.weight_mu.shape[0], -1).ne(0)
            assert bool((rows.all(1) | ~rows.any(1)).all())


@pytest.mark.filterwarnings("ignore:Using padding='same'")  # torch's, for the even kernel
def test_conv1d_exports_as_a_2d_convolution_and_conv3d_is_refused(tmp_path):
    """A Conv1d model (reflect padding, BatchNorm1d, groups, stride and dilation, 'same' with an even kernel, a
    removed output channel) exports and loads with the function of the Bayesian model, each Conv1d a conv2d."""
    from dturbo.export import ExportError, export_model, load

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv1d(3, 6, 3, padding=1, padding_mode="reflect"), nn.BatchNorm1d(6), nn.ReLU(),
                        nn.Conv1d(6, 4, 3, groups=2, stride=2, dilation=2), nn.Conv1d(4, 4, 4, padding="same"),
                        nn.Flatten(), nn.Linear(4 * 18, CLASSES))
    bayes = dturbo.bayesianize(net).eval()
    x = torch.randn(5, 3, 40)
    with torch.no_grad():
        bayes[0].mask[2] = 0  # output channel 2 removed: the support export reads
        bayes[1].running_mean.uniform_(-0.5, 0.5)
    want = bayes(x)
    export_model(bayes, tmp_path / "m", example_input=x)
    with torch.no_grad():
        torch.testing.assert_close(load(tmp_path / "m", batch_size=5)(x), want, rtol=1e-5, atol=1e-5)
    spec = json.loads((tmp_path / "m" / "model.json").read_text())
    assert [n["type"] for n in spec["ops"]].count("conv2d") == 3
    vol = dturbo.bayesianize(nn.Sequential(nn.Conv3d(2, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4 * 4, CLASSES)))
    with pytest.raises(ExportError, match="BayesConv3d"):
        export_model(vol.eval(), tmp_path / "v", example_input=torch.randn(2, 2, 6, 6, 6))


def copy_of(net: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(net)


# ------------------------------------------------------------------- the first layer names the inputs it takes
class Series(nn.Module):
    """A Conv1d on (N, 1, 24) series."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3)
        self.fc = nn.Linear(4 * 22, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 4)
        self.fc = nn.Linear(48, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.emb(x), 1))


class Tabular(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _split(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, ...]:
    return x[:240], y[:240], x[240:], y[240:]


def test_a_conv1d_model_takes_its_series_as_n_c_l_and_learns(tmp_path):
    """(N, 1, 24) arrays read "auto" would be 1x1x24 images; a model whose first layer is a Conv1d takes them as
    N, C, L series (recorded in the run's config), and learns them."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 1, 24)).astype(np.float32)
    y = (x[:, 0, :12].sum(1) > 0).astype(np.int64)
    exp = dturbo.Experiment(config("fedavg", 4, federation={"clients": 2}, train={"local_steps": 20}),
                            data=_split(x, y), model=Series,
                            out=tmp_path / "run", progress=False, figures=False)
    assert exp.config.data.layout == "channels_first" and exp.dataset.input_shape == (1, 24)
    res = exp.run()
    assert res.metrics[-1]["accuracy"] > 0.7  # 2 classes: chance is 0.5


@pytest.mark.parametrize(("model", "ints", "match"), [
    (Tokens, False, "first layer 'emb' is an Embedding, which takes integer ids, and the inputs are torch.float32"),
    (Tabular, True, r"the inputs are integers, read as ids \(torch.int64\), and its first layer 'fc' \(BayesLinear\) "
                    "takes floats: store the features as float32"),
])
def test_an_input_of_the_wrong_kind_is_named_as_such(tmp_path, model, ints, match):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(300, 12))
    x = x.astype(np.int64) if ints else x.astype(np.float32)
    with pytest.raises(ModelInputError, match=match):
        dturbo.Experiment(config("fedavg", 1), data=_split(x, rng.integers(0, 2, 300)), model=model,
                          out=tmp_path / "run", progress=False, figures=False)


def test_exporting_an_embedding_model_names_the_op_export_does_not_know(tmp_path):
    """The default example input of a model whose first layer is an embedding is ids (not floats cast from
    noise), so the export reaches the embedding and refuses it by name."""
    from dturbo.export import ExportError

    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(300, 12)).astype(np.int64)
    res = dturbo.Experiment(config("fedavg", 1), data=_split(x, rng.integers(0, 2, 300)), model=Tokens,
                            out=tmp_path / "run", progress=False, figures=False).run()
    with pytest.raises(ExportError, match="node 'emb' calls module 'emb' of type torch.nn.modules.sparse.Embedding"):
        res.export(tmp_path / "exported")
    assert not (tmp_path / "exported" / "model.json").exists()

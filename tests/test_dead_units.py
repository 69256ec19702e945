"""``[dturbo] dead_units = "cut"`` (dturbo.algorithms.dturbo.units): the weights joined to a unit that carries
nothing leave the support. The cut against an independent computation (a unit-by-unit loop to the fixed point) and
against export's compaction (which finds nothing left to remove on a cut model), on the built-in networks; a run
with the cut against one without (fewer values sent, no weight reading an empty unit) and its resume; a model whose
graph cannot be captured keeps every weight, with a warning that says why."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import dturbo
from dturbo import export as ex
from dturbo.algorithms.dturbo.layers import layer_infos
from dturbo.algorithms.dturbo.units import DeadUnits
from dturbo.nn.bayes import bayesian_layers
from dturbo.nn.models import build_model
from dturbo.settings import parse_config

CFG = parse_config({})
NETS = {"lenet5": (1, 28, 28), "alexnet-small": (1, 28, 28), "mlp": (20,)}


def _loop_cut(mus: list[np.ndarray], links: list[tuple[int, int, int]]) -> list[np.ndarray]:
    """The cut written unit by unit: an empty producer row empties the consumer's columns that read it, a unit no
    consumer column reads empties its producer row, until nothing changes (links no unit joins left alone)."""
    mus = [m.copy() for m in mus]
    changed = True
    while changed:
        changed = False
        for p, c, units in links:
            per = mus[c].shape[1] // units
            produced = [bool(np.any(mus[p][u] != 0)) for u in range(units)]
            used = [bool(np.any(mus[c][:, u * per:(u + 1) * per] != 0)) for u in range(units)]
            if not any(a and b for a, b in zip(produced, used, strict=True)):
                continue
            for u in range(units):
                if not produced[u] and used[u]:
                    mus[c][:, u * per:(u + 1) * per] = 0.0
                    changed = True
                if produced[u] and not used[u]:
                    mus[p][u] = 0.0
                    changed = True
    return mus


def _random_supports(model: nn.Module, rng: np.random.Generator) -> list[np.ndarray]:
    """Each layer's weights as a grid with whole rows emptied (units off the support) and scattered zeros."""
    out = []
    for _, layer in bayesian_layers(model):
        w = layer.weight_mu.detach().numpy().reshape(layer.weight_mu.shape[0], -1).copy()
        rows = rng.random(w.shape[0]) < 0.35
        rows[0] = False  # never a whole layer
        w[rows] = 0.0
        w[rng.random(w.shape) < 0.3] = 0.0
        out.append(w)
    return out


@pytest.mark.parametrize(("name", "seed"), itertools.product(NETS, range(3)))
def test_the_cut_equals_a_unit_by_unit_loop_and_leaves_export_nothing_to_remove(name, seed):
    model = build_model(name, NETS[name], 10, hidden=(24, 16), seed=seed)
    infos = layer_infos(model, CFG)
    dead = DeadUnits(model, infos)
    assert len(dead.links) == len(infos) - 1  # these networks are chains: every layer feeds the next
    mus = _random_supports(model, np.random.default_rng(seed))
    before = [m.copy() for m in mus]
    cut = dead.cut(mus)
    for got, want, was, given in zip(cut, _loop_cut(before, dead.links), before, mus, strict=True):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(given, was)  # the input is not modified
        assert not np.any((got != 0) & (was == 0))  # nothing is added
        assert np.any(got != 0)  # no layer is emptied
    assert sum(int((m != 0).sum()) for m in cut) < sum(int((m != 0).sum()) for m in before)
    for again, once in zip(dead.cut(cut), cut, strict=True):  # a fixed point
        np.testing.assert_array_equal(again, once)
    # export's compaction (its own code, on torch ops) removes the units that carry nothing: on the cut model each
    # layer it writes holds every nonzero weight, and nothing else is left to remove
    with torch.no_grad():
        for (_, layer), mu in zip(bayesian_layers(model), cut, strict=True):
            layer.weight_mu.copy_(torch.from_numpy(mu.reshape(layer.weight_mu.shape)))
            layer.mask.copy_(torch.from_numpy((mu != 0).reshape(layer.weight_mu.shape).astype(np.float32)))
    exported = ex.export_model(model, example_input=torch.zeros(2, *NETS[name]))
    nonzero = {r["name"]: r for r in exported.layers}
    for info, mu in zip(infos, cut, strict=True):
        row = nonzero[info.name.replace(".", "_")]
        assert int(np.prod(row["shape_after"])) >= int((mu != 0).sum())
        assert row["shape_after"][0] == int((mu != 0).any(axis=1).sum()) or info is infos[-1]


def _run(tmp_path: Path, tiny_config, make_toy, dead_units: str, rounds: int = 4) -> dict:
    return tiny_config(rounds=rounds, data={"name": "npz", "path": str(make_toy(300))},
                       model={"name": "mlp", "hidden": [16, 12]},
                       dturbo={"dead_units": dead_units, "prior": {"dense": {"tie_rows": True}},
                               "sparsity": {"target_density": 0.3, "warmup_rounds": 1, "ramp_rounds": 2}})


def test_a_cut_run_sends_fewer_values_keeps_no_weight_of_an_empty_unit_and_resumes_identically(
        tmp_path, tiny_config, make_toy):
    from run_helpers import cut_and_resume, rows_of

    from dturbo.sim import Simulator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in ("kept", "cut"):
            Simulator(parse_config(_run(tmp_path, tiny_config, make_toy, mode)), tmp_path / mode).run()
        cut_and_resume(_run(tmp_path, tiny_config, make_toy, "cut"), tmp_path / "whole", tmp_path / "part", 2)
    kept, cut = rows_of(tmp_path / "kept"), rows_of(tmp_path / "cut")
    assert float(cut[-1]["density"]) < float(kept[-1]["density"])
    assert sum(float(r["up_values_bits"]) for r in cut) < sum(float(r["up_values_bits"]) for r in kept)
    assert rows_of(tmp_path / "whole") == rows_of(tmp_path / "part")
    from safetensors.numpy import load_file

    w = load_file(str(tmp_path / "cut" / "model.safetensors"))
    for prod, cons in (("dense1", "dense2"), ("dense2", "dense3")):
        empty = ~(w[f"{prod}.weight_mu"] != 0).any(axis=1)
        assert not np.any(w[f"{cons}.weight_mu"][:, empty])


def test_a_model_whose_graph_cannot_be_captured_keeps_every_weight_and_says_why():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc1(x)
            return self.fc2(h if x.sum() > 0 else -h)

    model = dturbo.bayesianize(Branchy())
    infos = layer_infos(model, CFG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dead = DeadUnits(model, infos)  # the graph is read when first needed
    for shape in (None, ()):  # () is what a model made before its data was read records
        model.input_shape = shape
        with pytest.warns(UserWarning, match=r"dead_units = 'cut' cuts nothing: it needs the model's graph \(the "
                                             r"model records no input_shape: dturbo.bayesianize"):
            assert DeadUnits(model, infos).links == []
    model.input_shape = (4,)
    with pytest.warns(UserWarning, match=r"cuts nothing: it needs the model's graph \(cannot capture the graph of "
                                         r"Branchy with torch.fx"):
        assert dead.links == []
    mus = [np.zeros((6, 4)), np.ones((2, 6))]
    assert all(np.array_equal(a, b) for a, b in zip(dead.cut(mus), mus, strict=True))  # nothing is cut


def test_no_link_across_a_residual_addition_a_concatenation_or_a_grouped_convolution():
    """A unit that feeds an addition or a concatenation (or a depthwise filter) is not a channel of one next layer:
    the cut leaves those layers alone and links only the chains (BatchNorm between is folded, as export does)."""
    from test_export_model import DepthwiseCat, ResCNN

    found = {}
    for cls, shape in ((ResCNN, (1, 8, 8)), (DepthwiseCat, (3, 8, 8))):
        model = dturbo.bayesianize(cls())
        model.input_shape = shape
        infos = layer_infos(model, CFG)
        found[cls.__name__] = [(infos[p].name, infos[c].name, u) for p, c, u in DeadUnits(model, infos).links]
    assert found == {"ResCNN": [("conv1", "conv2", 8), ("fc1", "fc2", 32)],
                     "DepthwiseCat": [("head.0", "head.2", 10)]}

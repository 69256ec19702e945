"""The pruning schedule of target mode (docs/sparsity.md §2, docs/models.md#tune-for-a-new-dataset): warm-up and
ramp in rounds as set, or paced by local training when unset
(:func:`dturbo.algorithms.dturbo.sparsity.pruning_schedule`)."""

from __future__ import annotations

import csv
import itertools
import warnings
from pathlib import Path

import numpy as np
import pytest

import dturbo
from dturbo.algorithms.dturbo.checks import schedule_warning
from dturbo.algorithms.dturbo.config import SparsityConfig
from dturbo.algorithms.dturbo.sparsity import density_schedule, local_steps_a_round, pruning_schedule
from dturbo.algorithms.local import num_local_steps
from dturbo.config import ConfigError, TrainConfig
from dturbo.settings import load_config, parse_config
from dturbo.sim import ScheduleWarning

ROOT = Path(__file__).resolve().parents[1]
PACED = [SparsityConfig(), SparsityConfig(warmup_steps=0), SparsityConfig(warmup_steps=10, ramp_steps=1),
         SparsityConfig(warmup_steps=1000, ramp_steps=5000), SparsityConfig(warmup_rounds=2),
         SparsityConfig(ramp_rounds=3)]


def test_explicit_rounds_are_kept_whatever_the_local_steps():
    """The README's main job (configs/fmnist_quick.toml sets warmup_rounds 1, ramp_rounds 7) schedules exactly
    the densities it scheduled before the paced schedule existed, whatever the clients' local steps: its
    metrics.csv does not change."""
    cfg = load_config(ROOT / "configs" / "fmnist_quick.toml")
    sp = cfg.dturbo.sparsity
    assert (sp.warmup_rounds, sp.ramp_rounds) == (1, 7)
    for steps in (1, 4, 75, 94, 10_000):
        schedule = pruning_schedule(sp, cfg.experiment.rounds, steps)
        assert (schedule.warmup, schedule.ramp, schedule.paced) == (1, 7, False)
        assert [schedule.density(t, sp.target_density) for t in range(12)] == [
            density_schedule(t, target=0.25, warmup=1, ramp=7) for t in range(12)]


@pytest.mark.parametrize("sp", PACED)
def test_paced_schedule_is_monotone_and_reaches_the_target_within_the_run(sp):
    for rounds, steps in itertools.product(range(1, 41), (1, 2, 4, 9, 75, 500)):
        schedule = pruning_schedule(sp, rounds, steps)
        dens = [schedule.density(t, 0.25) for t in range(rounds)]
        assert all(b <= a for a, b in itertools.pairwise(dens)), (rounds, steps, dens)
        fits = (sp.warmup_rounds is None or sp.warmup_rounds < rounds) and (sp.ramp_rounds or 1) <= rounds
        assert dens[-1] == 0.25 or not fits, (rounds, steps, schedule)
        tree = {"experiment": {"rounds": rounds}, "dturbo": {"sparsity": sp.model_dump(exclude_none=True)}}
        cut = parse_config({**tree, "dturbo": {**tree["dturbo"], "global_model": "cut"}})
        assert (dens[-1] == 0.25) == (schedule_warning(cut, steps) is None)  # the final model on the last support
        # "trained": the final model on the support the round before the last decided
        final = dens[-2] if rounds >= 2 else 1.0
        assert (final == 0.25) == (schedule_warning(parse_config(tree), steps) is None)
        assert schedule.warmup >= 0 and schedule.ramp >= 1
        if rounds >= 2 and sp.warmup_rounds is None and sp.ramp_rounds is None:
            # one round trains at the target before the last support is evaluated
            assert schedule.reached_at <= rounds - 2, (rounds, steps, schedule)
            assert schedule.warmup <= (rounds - 1) // 2


def test_paced_warmup_is_the_rounds_that_train_warmup_steps_unless_capped():
    sp = SparsityConfig(warmup_steps=64, ramp_steps=500)
    for rounds, steps in itertools.product(range(2, 60), range(1, 130)):
        schedule = pruning_schedule(sp, rounds, steps)
        if schedule.warmup < (rounds - 1) // 2:  # not capped: the fewest rounds with >= 64 local steps
            assert schedule.warmup * steps >= 64 > (schedule.warmup - 1) * steps
        if schedule.ramp < rounds - schedule.warmup - 1:
            assert schedule.ramp * steps >= 500 > (schedule.ramp - 1) * steps
    # Whole Fashion-MNIST with validation, 10 clients (75 steps a round): the schedule fmnist_quick sets by hand;
    # 4 steps a round (a small dataset): the capped warm-up.
    for steps, rounds in ((75, (1, 7)), (4, (5, 6))):
        schedule = pruning_schedule(sp, 12, steps)
        assert (schedule.warmup, schedule.ramp, schedule.paced) == (*rounds, True)


def test_local_steps_a_round_is_the_mean_clients():
    train = TrainConfig(local_epochs=1.0, batch_size=64)
    assert local_steps_a_round(train, 1150, 5) == num_local_steps(train, 230) == 4
    assert local_steps_a_round(TrainConfig(local_steps=7), 10, 3) == 7


def test_paced_schedule_never_warns_and_explicit_too_long_does():
    for rounds, steps in itertools.product(range(1, 30), (1, 4, 75)):
        cfg = parse_config({"experiment": {"rounds": rounds}})
        # one round trains no pruned support: its final model is dense under "trained"
        assert (schedule_warning(cfg, steps) is None) == (rounds >= 2)
        cut = parse_config({"experiment": {"rounds": rounds}, "dturbo": {"global_model": "cut"}})
        assert schedule_warning(cut, steps) is None
    late = parse_config({"experiment": {"rounds": 4}, "dturbo": {"sparsity": {"warmup_rounds": 4}}})
    assert "warmup_rounds 4 + ramp_rounds 1 > experiment.rounds 4 - 1" in schedule_warning(late, 4)


def test_paced_config_round_trips_unset():
    """Unset rounds are left out of a run's config.toml, so a resumed run is paced again."""
    cfg = parse_config({})
    assert cfg.dturbo.sparsity.warmup_rounds is None and cfg.dturbo.sparsity.ramp_rounds is None
    text = cfg.to_toml()
    keys = [line.split("=")[0].strip() for line in text.splitlines()]
    assert "warmup_rounds" not in keys and "ramp_rounds" not in keys and "warmup_steps = 64" in text
    assert load_config(cfg.to_dict()) == cfg


@pytest.mark.parametrize(("key", "value", "message"), [
    ("warmup_steps", -1, "greater than or equal to 0"), ("ramp_steps", 0, "greater than or equal to 1"),
    ("warmup_rounds", -1, "greater than or equal to 0"), ("ramp_rounds", 0, "greater than or equal to 1"),
    ("warmup_steps", 1.5, "valid integer"), ("ramp_steps", "500", "valid integer"), ("warmup_steps", True, "integer"),
])
def test_bad_schedule_values_are_refused_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=rf"dturbo\.sparsity\.{key}'.*{message}"):
        parse_config({"dturbo": {"sparsity": {key: value}}})


def test_a_run_follows_the_paced_schedule(tmp_path, tiny_config):
    """End to end: 3 local steps a round, warmup_steps 6 and ramp_steps 6 over 6 rounds: 2 dense rounds, then a
    2-round ramp (the scheduled_density column), and the support never exceeds it."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 12)).astype(np.float32)
    y = ((x[:, :3].sum(1) > 0).astype(np.int64) + 2 * (x[:, 3] > 0))
    cfg = tiny_config(rounds=6, dturbo={"sparsity": {"target_density": 0.5, "warmup_steps": 6, "ramp_steps": 6}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleWarning)
        warnings.filterwarnings("ignore", "the median client trains only")
        dturbo.Experiment(cfg, data=(x, y, x[:100], y[:100]), out=tmp_path / "run", progress=False,
                          figures=False).run()
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    expected = [density_schedule(t, target=0.5, warmup=2, ramp=2) for t in range(6)]
    assert [float(r["scheduled_density"]) for r in rows] == pytest.approx(expected)
    assert all(float(r["support_density"]) <= float(r["scheduled_density"]) for r in rows)
    assert [float(r["density"]) for r in rows[:2]] == [1.0, 1.0]


def test_layer_targets_select_layers_by_name_position_or_kind():
    from dturbo.algorithms.dturbo.sparsity import resolve_layer_targets

    names = ["conv1", "conv2", "dense1", "dense2"]
    kinds = ["conv", "conv", "dense", "dense"]
    assert resolve_layer_targets(names, kinds, {"first": 1.0, "last": 1.0}) == {"conv1": 1.0, "dense2": 1.0}
    assert resolve_layer_targets(names, kinds, {"conv": 0.5, "last": 1.0}) == {"conv1": 0.5, "conv2": 0.5,
                                                                               "dense2": 1.0}
    # a name wins over a position, a position over a kind
    assert resolve_layer_targets(names, kinds, {"conv": 0.5, "first": 0.9, "conv1": 0.3}) == {"conv1": 0.3,
                                                                                           "conv2": 0.5}
    assert resolve_layer_targets(names, kinds, {"conv": 0.5, "first": 0.9}) == {"conv1": 0.9, "conv2": 0.5}
    # the last of a kind: between a position and the kind
    alex = ["conv1", "conv2", "conv3", "conv4", "dense1", "dense2", "dense3"]
    alex_kinds = ["conv"] * 4 + ["dense"] * 3
    assert resolve_layer_targets(alex, alex_kinds, {"conv": 0.5, "last_conv": 0.25, "last": 1.0}) == {
        "conv1": 0.5, "conv2": 0.5, "conv3": 0.5, "conv4": 0.25, "dense3": 1.0}
    assert resolve_layer_targets(alex, alex_kinds, {"first_dense": 0.3, "last_dense": 0.9, "last": 1.0}) == {
        "dense1": 0.3, "dense3": 1.0}
    with pytest.raises(ConfigError, match="'conv9'.*select them by first, last, first_tied"):
        resolve_layer_targets(names, kinds, {"conv9": 0.5})


def test_the_tied_group_selects_the_layers_whose_rows_are_tied():
    """``tied`` / ``last_tied`` pick the layers with tied rows only; on a model whose convolutions are all tied they
    are ``conv`` / ``last_conv``; a position among the tied wins over one among a kind, ``tied`` over a kind."""
    from dturbo.algorithms.dturbo.sparsity import resolve_layer_targets

    alex = ["conv1", "conv2", "conv3", "conv4", "dense1", "dense2", "dense3"]
    kinds = ["conv"] * 4 + ["dense"] * 3
    recommended = {"tied": 0.5, "last_tied": 0.25, "last": 1.0}
    all_tied = [True] * 4 + [False] * 3
    assert resolve_layer_targets(alex, kinds, recommended, all_tied) == resolve_layer_targets(
        alex, kinds, {"conv": 0.5, "last_conv": 0.25, "last": 1.0})
    assert resolve_layer_targets(alex, kinds, recommended) == {"dense3": 1.0}  # nothing tied: the last layer only
    lone = [False, False, True, False, False, False, False]  # first and last of the tied: either selects it
    assert resolve_layer_targets(alex, kinds, {"last_tied": 0.25}, lone) == {"conv3": 0.25}
    assert resolve_layer_targets(alex, kinds, {"first_tied": 0.3, "last_tied": 0.25}, lone) == {"conv3": 0.3}
    some = [False, True, True, False, False, False, False]
    assert resolve_layer_targets(alex, kinds, recommended | {"conv": 0.7, "last_conv": 0.6}, some) == {
        "conv1": 0.7, "conv2": 0.5, "conv3": 0.25, "conv4": 0.6, "dense3": 1.0}


def test_selectors_give_the_named_setting_the_same_run(tmp_path, tiny_config):
    """{first, last} on an mlp is {dense1, dense3}: the same resolved layer targets, the same metrics."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 12)).astype(np.float32)
    y = ((x[:, :3].sum(1) > 0).astype(np.int64) + 2 * (x[:, 3] > 0))
    named = load_config(tiny_config(rounds=3, model={"name": "mlp", "hidden": [16, 8]},
                                    dturbo={"sparsity": {"target_density": 0.4, "warmup_rounds": 0, "ramp_rounds": 2,
                                                         "layer_targets": {"dense1": 0.3, "dense3": 1.0}}}))
    chosen = load_config(named, ["dturbo.sparsity.layer_targets={first = 0.3, last = 1.0}"])
    rows = []
    for cfg, out in ((named, tmp_path / "a"), (chosen, tmp_path / "b")):
        dturbo.Experiment(cfg, data=(x, y, x[:100], y[:100]), out=out, progress=False, figures=False).run()
        with open(out / "metrics.csv", newline="") as f:
            rows.append([{k: v for k, v in r.items() if k not in ("seconds", "server_seconds")}
                         for r in csv.DictReader(f)])
    assert rows[0] == rows[1]


def _erk_layers(normalised: tuple[bool, ...]) -> list:
    from dturbo.algorithms.dturbo.prior import resolve_prior
    from dturbo.algorithms.dturbo.turbo import LayerInfo

    prior = resolve_prior(parse_config({}).dturbo.prior.conv, 0.1)
    shapes = [(8, 1, 3, 3), (16, 8, 3, 3), (32, 16, 3, 3), (10, 512)]
    return [LayerInfo(f"l{i}", (s[0], int(np.prod(s[1:]))), prior, kind="conv" if len(s) == 4 else "dense",
                      normalised=n, shape=s) for i, (s, n) in enumerate(zip(shapes, normalised, strict=True))]


def test_erk_targets_keep_the_budget_and_follow_the_rule():
    """distribution 'erk': every layer's target is eps * sum(shape) / prod(shape) below the cap of 1, and together
    they keep exactly target_density of the weights; a named layer keeps its target and the rule spreads the rest;
    'auto' gives the rule only the layers BatchNorm follows and leaves the others to the shared field (NaN), which
    then takes exactly what the rule's spread leaves; 'evidence' gives no layer a target."""
    from dturbo.algorithms.dturbo.sparsity import budget_sizes, layer_targets

    layers = _erk_layers((True, True, True, False))
    sizes = np.array([np.prod(i.shape) for i in layers], dtype=float)
    raw = np.array([sum(i.shape) / np.prod(i.shape) for i in layers])
    for density in (0.1, 0.3, 0.7):
        sp = SparsityConfig(target_density=density, distribution="erk")
        t = layer_targets(layers, sp)
        assert (t * sizes).sum() == pytest.approx(density * sizes.sum(), rel=1e-12)
        free = t < 1.0
        assert np.all(t <= 1.0) and free.any()
        np.testing.assert_allclose(t[free] / raw[free], (t[free] / raw[free])[0], rtol=1e-12)
        assert np.all(raw[~free] >= raw[free].max())  # only the densest by the rule reach the cap
    named = layer_targets(layers, SparsityConfig(target_density=0.3, distribution="erk", layer_targets={"l2": 0.5}))
    assert named[2] == 0.5 and (named * sizes).sum() == pytest.approx(0.3 * sizes.sum(), rel=1e-12)
    sp = SparsityConfig(target_density=0.3, distribution="auto")
    auto = layer_targets(layers, sp)
    erk = layer_targets(layers, SparsityConfig(target_density=0.3, distribution="erk"))
    np.testing.assert_array_equal(auto[:3], erk[:3])
    assert np.isnan(auto[3])
    assert np.isnan(layer_targets(layers, SparsityConfig(target_density=0.3, distribution="evidence"))).all()
    assert np.isnan(layer_targets(_erk_layers((False,) * 4), sp)).all()  # no BatchNorm: the shared field, as ever
    assert (budget_sizes(layers, sp) == sizes).all()


def test_the_trained_global_model_is_the_aggregate_before_the_cut(tmp_path, tiny_config):
    """``global_model = "trained"`` changes which model a round ends with, not the training: the messages (bits)
    are the same bytes as the default's, the model of round r carries the support of round r - 1 (its clients
    trained on it; the default's density one round later), and its weights are the default's wherever both hold
    one."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(240, 12)).astype(np.float32)
    y = ((x[:, :3].sum(1) > 0).astype(np.int64) + 2 * (x[:, 3] > 0))
    rows, models = {}, {}
    for mode in ("cut", "trained"):
        cfg = tiny_config(rounds=5, dturbo={"global_model": mode,
                                            "sparsity": {"target_density": 0.3, "warmup_rounds": 1, "ramp_rounds": 3}})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = dturbo.Experiment(cfg, data=(x, y, x[:100], y[:100]), out=tmp_path / mode, progress=False,
                                    figures=False).run()
        with open(tmp_path / mode / "metrics.csv") as f:
            rows[mode] = list(csv.DictReader(f))
        models[mode] = {n: p.detach().numpy() for n, p in res.model.named_parameters() if n.endswith("weight_mu")}
    cut, trained = rows["cut"], rows["trained"]
    for key in ("up_bits", "down_bits", "cum_bits"):
        assert [r[key] for r in cut] == [r[key] for r in trained], key
    density = [float(r["density"]) for r in cut]
    assert density[1] < density[0] == 1.0  # the ramp cuts
    assert [float(r["density"]) for r in trained] == pytest.approx([1.0, *density[:-1]])
    for name, w in models["trained"].items():
        both = (w != 0) & (models["cut"][name] != 0)
        np.testing.assert_array_equal(w[both], models["cut"][name][both])


def test_a_resumed_trained_model_run_equals_an_uninterrupted_one(tmp_path, tiny_config, make_toy):
    """The round's model before the cut is checkpointed with the state: a run stopped during the ramp and resumed
    writes the uninterrupted run's metrics."""
    from run_helpers import cut_and_resume, rows_of

    cfg = tiny_config(rounds=4, data={"name": "npz", "path": str(make_toy(300))},
                      dturbo={"global_model": "trained",
                              "sparsity": {"target_density": 0.3, "warmup_rounds": 1, "ramp_rounds": 3}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cut_and_resume(cfg, tmp_path / "whole", tmp_path / "part", 2)
    assert rows_of(tmp_path / "whole") == rows_of(tmp_path / "part")


def test_the_evaluation_downlink_carries_the_trained_model(make_toy):
    """BatchNorm calibration and Flower's federated evaluation load the model the server evaluates: with
    ``global_model = "trained"`` a client receiving the evaluation downlink holds the support of :meth:`global_model`,
    which keeps weights the decided support has cut."""
    from dturbo.algorithms.registry import build_algorithm
    from dturbo.federation import build_federation
    from dturbo.nn.bayes import bayesian_layers

    cfg = parse_config({"experiment": {"seed": 2, "rounds": 3, "threads": 1},
                        "data": {"name": "npz", "path": str(make_toy(300))},
                        "federation": {"clients": 3, "partition": "iid"}, "model": {"name": "mlp", "hidden": [16]},
                        "train": {"local_steps": 3, "lr": 0.01},
                        "dturbo": {"global_model": "trained",
                                   "sparsity": {"target_density": 0.3, "warmup_rounds": 0, "ramp_rounds": 1}}})
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    state = server.init()
    down = server.downlinks(state, 0, [0, 1, 2])
    state = server.aggregate(state, [client.fit(down[c], fed.clients[c], c) for c in range(3)], 0).state
    held = [layer.mask.numpy() for _, layer in bayesian_layers(client.receive(server.evaluation_downlink(state, 1), 0))]
    model = [layer.mask.numpy() for _, layer in bayesian_layers(server.global_model(state))]
    decided = [server.support(state, info) for info in server.layers]
    assert any(m.sum() > d.sum() for m, d in zip(model, decided, strict=True))  # the ramp cut weights
    for h, m in zip(held, model, strict=True):
        np.testing.assert_array_equal(h.reshape(m.shape), m)


def test_a_run_written_before_global_model_resumes_as_cut_and_says_so(tmp_path, tiny_config, make_toy):
    """A run whose config.toml predates the key ran "cut": it reads back as "cut", resumes with it, and resuming it
    under today's default names the key and both values."""
    from dturbo.checkpoint import CheckpointError
    from dturbo.rundir import RunDir
    from dturbo.sim import Simulator

    tree = tiny_config(rounds=3, data={"name": "npz", "path": str(make_toy(300))},
                       dturbo={"global_model": "cut", "sparsity": {"target_density": 0.5, "warmup_rounds": 0,
                                                                   "ramp_rounds": 1}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Simulator(parse_config({**tree, "experiment": {**tree["experiment"], "rounds": 1}}), tmp_path / "run").run()
    toml = tmp_path / "run" / "config.toml"
    toml.write_text(toml.read_text().replace('global_model = "cut"\n', ""))  # as an older dturbo wrote it
    assert RunDir(tmp_path / "run").config().dturbo.global_model == "cut"
    today = {**tree, "dturbo": {k: v for k, v in tree["dturbo"].items() if k != "global_model"}}
    with pytest.raises(CheckpointError, match=r"dturbo\.global_model \('cut' -> 'trained'\)"):
        Simulator(parse_config(today), tmp_path / "run", resume=True).run()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = Simulator(parse_config(tree), tmp_path / "run", resume=True).run()
    assert [int(r["round"]) for r in rows][-1] == 3

"""BatchNorm's running statistics measured on the global model (dturbo.algorithms.statistics): exact against
statistics computed independently, pooled exactly, in the ledger, refused when hostile, and the global model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_user_models import ResNetTiny, config, images, rows, run, server_state
from torch import nn

import dturbo
from dturbo.algorithms.base import ClientData
from dturbo.algorithms.dturbo import layer_infos
from dturbo.algorithms.dturbo.layers import followed_by_batchnorm
from dturbo.algorithms.robust import RobustAggregation
from dturbo.algorithms.statistics import Statistics, _kind
from dturbo.codec import decode_dense, decode_message, encode_dense, encode_message
from dturbo.config import RobustConfig
from dturbo.settings import parse_config
from dturbo.sim import Simulator
from dturbo.transport import InProcessClients

pytestmark = pytest.mark.filterwarnings("ignore::dturbo.sim.ScheduleWarning")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.LazyLinear(2))


def test_a_client_measures_the_input_of_every_batchnorm_over_all_its_samples():
    net = _net()
    x = torch.randn(37, 1, 6, 6)
    net(x)  # materialise the lazy layer
    reply = Statistics(net).measure(net, ClientData(x, torch.zeros(37, dtype=torch.long)), 10, torch.device("cpu"))
    got = dict(decode_message(reply)[1])
    stats = Statistics(net).decode(reply)
    with torch.no_grad():
        h = net[0](x).double().transpose(0, 1).reshape(4, -1)
    np.testing.assert_allclose(stats["1"][0], h.mean(1).numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(stats["1"][1], h.var(1, unbiased=False).numpy(), rtol=1e-5)
    assert set(got) == {"1.mean", "1.var", "4.mean", "4.var"} and not net.training
    # the second layer's input: each batch normalised by its own statistics, as in local training
    with torch.no_grad():
        net.train()
        outs = [net[3](net[2](net[1](net[0](x[i : i + 10])))) for i in range(0, 37, 10)]
    h2 = torch.cat(outs).double().transpose(0, 1).reshape(3, -1)
    np.testing.assert_allclose(stats["4"][0], h2.mean(1).numpy(), rtol=1e-5, atol=1e-6)


def test_pooled_statistics_are_those_of_the_union():
    rng = np.random.default_rng(1)
    parts = [rng.normal(m, s, size=(n, 3)) for m, s, n in ((0.0, 1.0, 40), (2.0, 0.5, 10), (-1.0, 2.0, 25))]
    net = nn.Sequential(nn.BatchNorm1d(3))
    stats = Statistics(net)
    decoded = [{"0": (p.mean(0), p.var(0))} for p in parts]
    pooled = stats.pool({"x": 1}, [len(p) for p in parts], decoded)
    union = np.concatenate(parts)
    np.testing.assert_allclose(pooled["0.running_mean.plain"], union.mean(0), rtol=1e-6)
    np.testing.assert_allclose(pooled["0.running_var.plain"], union.var(0), rtol=1e-6)
    assert pooled["x"] == 1


# (algorithm, its own section, how far the clients' copy of the model is from the server's: float32 none, a lossy
# downlink a little)
CASES = {"fedavg32": ("fedavg", {"fedavg": {"dtype": "float32"}}, 1e-5), "dturbo": ("dturbo", {}, 0.03),
         "stc": ("stc", {}, 0.01), "feddst": ("feddst", {}, 0.01)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_global_model_carries_the_statistics_of_its_own_weights(tmp_path, case):
    algorithm, section, tol = CASES[case]
    exp = dturbo.Experiment(config(algorithm, 2, **section), data=images(), model=ResNetTiny, out=tmp_path / "run",
                            progress=False, figures=False)
    res = exp.run()
    model = res.model.eval()
    x = torch.from_numpy(exp.dataset.x_train).float()
    with torch.no_grad():
        h = model.stem[0](x).double().transpose(0, 1).reshape(8, -1)  # every client's data: all take part
    mean, var = h.mean(1), h.var(1, unbiased=False)
    torch.testing.assert_close(model.stem[1].running_mean.double(), mean, rtol=tol, atol=tol * var.mean().sqrt())
    torch.testing.assert_close(model.stem[1].running_var.double(), var, rtol=tol, atol=1e-6)
    averaged = run(tmp_path / "averaged", ResNetTiny, algorithm=algorithm, rounds=2,
                   federation={"batchnorm": "averaged"}, **section)
    assert (averaged.model.stem[1].running_var.double() - var).abs().max() > 5 * tol * var.max()
    # the calibration's messages are in the ledger, split by part like every message
    for r in res.metrics:
        assert r["calibration_bits"] > 0
        for d in ("up", "down"):
            assert sum(r[f"{d}_{p}_bits"] for p in ("headers", "positions", "values")) == r[f"{d}_bits"]
    bits = [r["up_bits"] + r["down_bits"] for r in res.metrics]
    assert [b - c["calibration_bits"] for b, c in zip(bits, res.metrics, strict=True)] == [
        r["up_bits"] + r["down_bits"] for r in averaged.metrics]


def test_a_model_without_batchnorm_sends_nothing_more(tmp_path):
    from test_user_models import DepthwiseNet

    res = run(tmp_path / "run", DepthwiseNet, rounds=2)
    assert all("calibration_bits" not in r for r in rows(tmp_path / "run"))
    assert res.metrics[-1]["cum_bits"] == sum(r["up_bits"] + r["down_bits"] for r in res.metrics)


class HostileStatistics(InProcessClients):
    """Client 0 answers every calibration with negative variances, client 1 with a NaN mean."""

    def __call__(self, downlinks, round_idx):
        replies = super().__call__(downlinks, round_idx)
        for cid in (0, 1):
            if cid in downlinks and _kind(downlinks[cid]) == "calibrate":
                fields = []
                for name, payload in decode_message(replies[cid])[1]:
                    if cid == 0 and name.endswith(".var"):
                        payload = encode_dense(-np.ones(8), dtype="float32")
                    elif cid == 1 and name.endswith(".mean"):  # the codec refuses to write a NaN: put it in
                        payload = payload[:-4] + np.float32(np.nan).tobytes()
                    fields.append((name, payload))
                replies[cid] = encode_message("statistics", fields)
        return replies


def _run_with(carrier: type[InProcessClients], out, rounds: int) -> tuple[Simulator, str]:
    """A D-Turbo-VBI run of ResNetTiny whose clients are reached through ``carrier``: the simulator and events.log."""
    exp = dturbo.Experiment(config("dturbo", rounds), data=images(), model=ResNetTiny, out=out, progress=False,
                            figures=False)
    sim = Simulator(exp.config, exp.out, dataset=exp.dataset, model=exp._model_factory)
    sim.transport = carrier(sim.client, sim.fed.clients)
    sim.run()
    return sim, sim.run_dir.events_path.read_text()


def test_hostile_statistics_are_refused_and_the_others_pooled(tmp_path):
    sim, log = _run_with(HostileStatistics, tmp_path / "run", 2)
    assert log.count("BatchNorm statistics rejected") == 4  # 2 clients, 2 rounds
    state = server_state(tmp_path / "run")
    assert np.all(np.isfinite(state["stem.1.running_mean.plain"])) and np.all(state["stem.1.running_var.plain"] > 0)
    # what client 2 alone measured on the final model
    model = sim.final_model
    x = sim.fed.clients[2].x
    with torch.no_grad():
        h = model.stem[0](x).double().transpose(0, 1).reshape(8, -1)
    # (the client measures its copy, from an 8-bit downlink: within a hundredth of a standard deviation)
    np.testing.assert_allclose(state["stem.1.running_mean.plain"], h.mean(1).numpy(), rtol=0,
                               atol=0.01 * float(h.std(1).min()))


def test_a_method_that_cannot_calibrate_says_so_and_averages(tmp_path):
    with pytest.warns(UserWarning, match="fedpm cannot calibrate BatchNorm statistics"):
        res = run(tmp_path / "run", ResNetTiny, algorithm="fedpm", rounds=1)
    assert "calibration_bits" not in res.metrics[0]


def test_one_channel_filters_before_batchnorm_stay_dense_unless_named(tmp_path):
    """A conv whose filters read one input channel keeps all its weights in a model with BatchNorm (its pruned
    filter would detect something else at full strength); the other layers are pruned as usual; naming it in
    layer_targets prunes it; without BatchNorm it is pruned like any layer."""
    from test_user_models import DepthwiseNet

    kept = run(tmp_path / "kept", ResNetTiny, rounds=3).metrics[-1]
    assert kept["density_stem.0"] == 1.0 and kept["density_block.conv1"] < 0.6 and kept["density_head"] < 0.75
    named = run(tmp_path / "named", ResNetTiny, rounds=3,
                dturbo={"sparsity": {"target_density": 0.4, "warmup_rounds": 0, "ramp_rounds": 2,
                                     "layer_targets": {"first_conv": 0.5}}}).metrics[-1]
    assert named["density_stem.0"] < 0.75
    plain = run(tmp_path / "plain", DepthwiseNet, rounds=3).metrics[-1]
    assert plain["density_dw"] < 0.75 and plain["density_stem"] < 0.75


def test_the_layers_batchnorm_follows_are_found():
    """A conv right before BatchNorm over its channels, one without bias through ReLU and pooling, a linear before
    BatchNorm1d; not a conv with bias through ReLU (its bias breaks the scale), nor a layer of another width, nor
    the head; with distribution 'auto' the found layers get their own targets and the head shares the field."""
    net = dturbo.bayesianize(nn.Sequential(
        nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4),
        nn.Conv2d(4, 4, 3, bias=False), nn.ReLU(), nn.MaxPool2d(2), nn.BatchNorm2d(4),
        nn.Conv2d(4, 4, 3), nn.ReLU(), nn.BatchNorm2d(4),
        nn.Conv2d(4, 2, 1, bias=False), nn.BatchNorm2d(4), nn.Flatten(),
        nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)))
    assert followed_by_batchnorm(net) == {"0", "2", "12"}
    cfg = parse_config({})
    infos = layer_infos(net, cfg)
    assert [i.name for i in infos if i.normalised] == ["0", "2", "12"]
    assert infos[1].shape == (4, 4, 3, 3)
    from dturbo.algorithms.dturbo.sparsity import layer_targets
    targets = dict(zip([i.name for i in infos], layer_targets(infos, cfg.dturbo.sparsity), strict=True))
    assert targets["0"] == 1.0  # one input channel: kept dense
    assert not np.isnan(targets["2"]) and not np.isnan(targets["12"])
    assert np.isnan(targets["6"]) and np.isnan(targets["9"]) and np.isnan(targets["14"])


def test_rows_tied_without_batchnorm_tie_the_convolutions_batchnorm_does_not_follow():
    """``tie_rows = "without_batchnorm"`` ties the rows of the conv without BatchNorm after it only; the client's
    priors rebuilt on the server's scales keep the same ties; the `recommended` preset's targets then fix that conv
    and the last layer and leave the rest to share target_density, which the model reaches."""
    from dturbo.algorithms.dturbo.client import DturboClient
    from dturbo.algorithms.dturbo.sparsity import budget_sizes, layer_targets

    net = dturbo.bayesianize(nn.Sequential(
        nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 16, 3, bias=False),
        nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3), nn.ReLU(), nn.Conv2d(8, 32, 3, bias=False),
        nn.BatchNorm2d(32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 3)), input_shape=(1, 12, 12))
    cfg = dturbo.load_config(preset="recommended")
    infos = layer_infos(net, cfg)
    assert [i.name for i in infos if i.prior.tie_rows] == ["6"]
    assert [i.name for i in infos if i.normalised] == ["0", "3", "8"]
    client = DturboClient(cfg, lambda: net)
    client.use_server_priors([0.1] * len(infos))
    assert [i.prior.tie_rows for i in client.layers] == [i.prior.tie_rows for i in infos]
    targets = layer_targets(infos, cfg.dturbo.sparsity)
    by_name = dict(zip([i.name for i in infos], targets, strict=True))
    assert by_name["0"] == 1.0 and by_name["6"] == 0.25 and by_name["12"] == 1.0  # the last tied layer: a quarter
    sizes = budget_sizes(infos, cfg.dturbo.sparsity)
    assert float((targets * sizes).sum() / sizes.sum()) == pytest.approx(0.17)
    everywhere = dturbo.load_config(preset="recommended", overrides={"dturbo.prior.conv.tie_rows": True})
    assert all(i.prior.tie_rows for i in layer_infos(net, everywhere) if i.kind == "conv")


# ---------------------------------------------------------------------- every value a client sends, one gate
class PoisonedStatistics(InProcessClients):
    """Client 0 answers every calibration with variances of 1e6 (finite, beyond what float16 carries pooled); an
    extra reply comes from a client that was not asked."""

    def __call__(self, downlinks, round_idx):
        replies = super().__call__(downlinks, round_idx)
        if 0 in downlinks and _kind(downlinks[0]) == "calibrate":
            fields = [(name, encode_dense(np.full(8, 1e6), dtype="float32") if name.endswith(".var") else payload)
                      for name, payload in decode_message(replies[0])[1]]
            replies[0] = encode_message("statistics", fields)
            replies[7] = replies[1]
        return replies


def test_statistics_beyond_the_bound_or_from_a_client_not_asked_are_refused_and_the_run_goes_on(tmp_path):
    _, log = _run_with(PoisonedStatistics, tmp_path / "run", 3)
    assert log.count("magnitude 1e+06, beyond the bound 10000") == 3
    assert log.count("client 7: BatchNorm statistics refused") == 3
    state = server_state(tmp_path / "run")
    assert float(state["stem.1.running_var.plain"].max()) < 100


def test_a_robust_rule_pools_the_statistics_so_that_a_few_clients_cannot_move_them():
    """3 of 10 clients report variances of 9000 (inside the bound): the weighted pool follows them, the median
    stays with the honest clients' spread."""
    from dturbo.algorithms.robust import Median

    stats = Statistics(_net())
    rng = np.random.default_rng(0)
    honest = [{n.name: (rng.normal(0, 0.1, n.channels), 1 + rng.random(n.channels)) for n in stats.norms}
              for _ in range(7)]
    hostile = [{n.name: (np.zeros(n.channels), np.full(n.channels, 9000.0)) for n in stats.norms} for _ in range(3)]
    weights = [1.0] * 10
    plain = stats.pool({}, weights, honest + hostile)
    robust = stats.pool({}, weights, honest + hostile, Median())
    key = stats.norms[0].fields[1]
    assert plain[key].min() > 2000 and robust[key].max() < 2.5


def _poison_plain(upload: bytes, key: str, value: float) -> bytes:
    kind, fields = decode_message(upload)
    out = [(n, encode_dense(np.full_like(decode_dense(p), value), dtype="float16") if n == f"{key}.plain" else p)
           for n, p in fields]
    return encode_message(kind, out)


@pytest.mark.parametrize("algorithm", ["dturbo", "fedavg"])
def test_the_plain_state_passes_the_bound_and_the_robust_rule(algorithm):
    """BatchNorm's state outside the Bayesian layers: a running variance of 6e4 (inside float16) is refused by the
    bound; 3 of 10 uploads at 9000 (inside it) move the weighted mean, not the median."""
    cfg = config(algorithm, 1, federation={"clients": 10}, robust={"rule": "median"})
    exp = dturbo.Experiment(cfg, data=images(), model=ResNetTiny, out="unused", progress=False, figures=False)
    sim = Simulator(exp.config, exp.out, dataset=exp.dataset, model=exp._model_factory)
    server, client = sim.server, sim.client
    state = server.init()
    down = server.downlinks(state, 0, list(range(10)))
    ups = [client.fit(down[c], sim.fed.clients[c], c) for c in range(10)]
    key = "stem.1.running_var"
    result = server.aggregate(state, [_poison_plain(ups[0], key, 6e4)] + ups[1:], 0, list(range(10)))
    assert [r.uplink for r in result.rejected] == [0] and "beyond the bound" in result.rejected[0].reason
    poisoned = [_poison_plain(u, key, 9000.0) for u in ups[:3]] + ups[3:]
    robust = server.aggregate(state, poisoned, 0, list(range(10))).state[f"{key}.plain"]
    server.robust = RobustAggregation(RobustConfig())
    plain = server.aggregate(state, poisoned, 0, list(range(10))).state[f"{key}.plain"]
    assert plain.min() > 2000 and robust.max() < 100


def _fitted(rule: dict) -> tuple:
    cfg = config("fedavg", 1, federation={"clients": 10}, robust=rule)
    exp = dturbo.Experiment(cfg, data=images(), model=ResNetTiny, out="unused", progress=False, figures=False)
    sim = Simulator(exp.config, exp.out, dataset=exp.dataset, model=exp._model_factory)
    state = sim.server.init()
    down = sim.server.downlinks(state, 0, list(range(10)))
    return sim.server, state, [sim.client.fit(down[c], sim.fed.clients[c], c) for c in range(10)]


def test_a_trained_batchnorm_weight_is_bounded_by_the_global_one_its_running_statistics_by_the_cap():
    """BatchNorm's weight is a trained parameter: 20 (the global weight is 1, so its bound is 16) is refused; its
    running variance follows the data: 1000 (inside the cap) is accepted."""
    server, state, ups = _fitted({})
    ups = [_poison_plain(ups[0], "stem.1.weight", 20.0), _poison_plain(ups[1], "stem.1.running_var", 1000.0)] + ups[2:]
    result = server.aggregate(state, ups, 0, list(range(10)))
    assert [r.uplink for r in result.rejected] == [0]
    assert "stem.1.weight.plain holds a value of magnitude 20, beyond the bound 16" in result.rejected[0].reason
    assert float(result.state["stem.1.running_var.plain"].max()) > 1000 / 9 - 1


@pytest.mark.parametrize("rule", [{"rule": "krum", "byzantine": 3}, {"rule": "centered_clip", "radius": 0.5}])
def test_krum_and_centered_clipping_keep_the_plain_state_with_the_honest_clients(rule):
    """3 of 10 uploads reverse BatchNorm's weight to -12 (inside its bound): Krum leaves them out, centered clipping
    takes the coordinate-wise median of the plain state; either stays with the honest clients, the plain mean
    follows the attackers."""
    from dturbo.algorithms.robust import Krum, Median, make_rule

    assert isinstance(make_rule(RobustConfig(**rule)).for_state(), Krum if rule["rule"] == "krum" else Median)
    server, state, ups = _fitted(rule)
    poisoned = [_poison_plain(u, "stem.1.weight", -12.0) for u in ups[:3]] + ups[3:]
    honest = np.stack([decode_dense(dict(decode_message(u)[1])["stem.1.weight.plain"]) for u in ups[3:]])
    robust = server.aggregate(state, poisoned, 0, list(range(10))).state["stem.1.weight.plain"]
    assert np.all(robust >= honest.min(axis=0) - 1e-6) and np.all(robust <= honest.max(axis=0) + 1e-6)
    server.robust = RobustAggregation(RobustConfig())
    assert float(server.aggregate(state, poisoned, 0, list(range(10))).state["stem.1.weight.plain"].max()) < -2

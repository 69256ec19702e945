"""``[dturbo.transmission] down_mu = "update"`` (docs/communication.md, "The downlink as an update"): mu_G travels
as the quantised update from the weights each client holds from its last downlink. The server and the client
agree on those weights bit for bit, the rounding error of one downlink is sent again in the next (so it never
accumulates), the rounding is unbiased, and a run resumes to the same run and runs the same on Flower."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from run_helpers import cut_and_resume, flower_and_simulator, rows_of
from test_positions_delta import assert_same_model
from test_positions_delta import config as delta_config

from dturbo.algorithms.base import MessageError
from dturbo.algorithms.dturbo import DturboClient
from dturbo.algorithms.dturbo.config import TransmissionConfig
from dturbo.algorithms.dturbo.messages import DownLayer, DturboDownlink, updated_weights
from dturbo.algorithms.registry import build_algorithm
from dturbo.federation import build_federation
from dturbo.settings import parse_config
from dturbo.sim import Simulator

BITS = 4
LEVELS = 2**BITS


@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(600)


def config(toy: Path, rounds: int = 6, down_mu: str = "update", down_bits: int = BITS, **sections) -> dict:
    """The frontier's transmission with positions as differences and the downlink at 4 bits, as an update."""
    cfg = delta_config(toy, "delta", rounds, **sections)
    cfg["dturbo"]["transmission"] |= {"down_bits": down_bits, "down_mu": down_mu}
    return cfg


def test_an_update_needs_positions_as_differences_and_quantised_values():
    TransmissionConfig(positions="delta", down_bits=4, down_mu="update")
    for bad in ({"positions": "full", "down_bits": 4}, {"positions": "delta", "down_bits": 16}):
        with pytest.raises(ValidationError, match="down_mu = 'update' needs positions = 'delta'"):
            TransmissionConfig(down_mu="update", **bad)


# ----------------------------------------------------------------------------------- the coding alone
def _record(mu: np.ndarray, support: np.ndarray, round_idx: int = 0) -> DturboDownlink:
    layer = DownLayer(mu=mu * support, support=support, sigma=np.ones(1), prior_std=None, bias=np.zeros(0))
    return DturboDownlink(round_idx, 100, [layer], {})


@pytest.fixture(scope="module")
def messages(toy):
    """The downlink's messages of a one-layer model is all :meth:`encode_update` reads: any server's will do."""
    cfg = parse_config(config(toy))
    server, _ = build_algorithm(cfg, build_federation(cfg))
    return server.messages


def test_the_weights_held_track_mu_g_within_one_level(messages):
    """One downlink: R' = R + the decoded update on S (0 off S), |R' - mu_G| on S below one level spacing of the
    update's range, 2 max|mu_G - R| / (L - 1); a second downlink of the same mu_G from R' shrinks the error by the
    same factor (what one rounds off, the next sends), so after t downlinks it is below (2 / (L - 1))**t max|mu_G|."""
    rng = np.random.default_rng(1)
    support = rng.random((30, 40)) < 0.4
    mu = rng.normal(size=support.shape)
    held = None
    bound = np.abs(mu[support]).max()
    for t in range(4):
        steps, (after,) = messages.encode_update(_record(mu, support, t), client_id=3, weights=held)
        assert after.dtype == np.float32 and not after[~support].any()
        err = np.abs(after[support] - mu[support]).max()
        bound *= 2 / (LEVELS - 1)
        assert err <= bound * (1 + 1e-6) + 1e-6, (t, err, bound)
        held = [after]
    assert err < 1e-3 * np.abs(mu).max()


def test_the_update_is_unbiased(messages):
    """E[R'] = mu_G: the mean of R' over 4000 clients (independent draws, seeded by the client) is within 4
    standard errors of mu_G on every weight, from zeros and from a held R."""
    rng = np.random.default_rng(2)
    support = rng.random((6, 8)) < 0.7
    mu = rng.normal(size=support.shape)
    for held in (None, [rng.normal(size=support.shape).astype(np.float32) * support]):
        draws = np.stack([messages.encode_update(_record(mu, support), c, held)[1][0] for c in range(4000)])
        spacing = 2 * np.abs(mu - (0 if held is None else held[0]))[support].max() / (LEVELS - 1)
        se = spacing / 2 / np.sqrt(len(draws))  # a two-point rounding's std is at most half a spacing
        assert np.all(np.abs(draws.mean(0)[support] - mu[support]) < 4 * se)


# ----------------------------------------------------------------------------- server and client halves
@pytest.fixture(params=[(BITS, "max", "float16"), (2, "clipped", "float16"), (1, "clipped", "float16"),
                        (3, "sign", "float16"), (3, "settled_sign", "float16"), (3, "ternary", "float16"),
                        (3, "settled_ternary", "float16"), (BITS, "max", "as_mu"), (3, "settled_sign", "as_mu"),
                        (3, "settled_sign", "nearest")],
                ids=["4max", "2clipped", "1clipped", "sign", "settled_sign", "ternary", "settled_ternary",
                     "4max_biases", "settled_sign_biases", "settled_sign_nearest"])
def halves(toy, request):
    bits, levels, option = request.param
    extra = {"down_rounding": "nearest"} if option == "nearest" else {"biases": option}
    cfg = parse_config(config(toy, 4, down_bits=bits, federation={"clients": 3},
                              transmission={"down_quantizer": levels} | extra))
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    return cfg, fed, server, client


def test_the_server_knows_the_weights_each_client_holds(halves):
    """After every round the server's ``held_mu`` (with ``biases = "as_mu"`` also ``held_bias``) of a client equals,
    bit for bit, the weights that client decoded (and trained from); a client that missed the round keeps the older
    weights on both sides, and one whose upload is lost is sent mu_G from zeros next time."""
    cfg, fed, server, client = halves
    state = server.init()
    for rnd, (senders, lost) in enumerate([((0, 1, 2), ()), ((0, 1), ()), ((0, 1, 2), (2,)), ((0, 1, 2), ())]):
        down = server.downlinks(state, rnd, list(senders))
        ups = [client.fit(down[c], fed.clients[c], c) for c in senders if c not in lost]
        state = server.aggregate(state, ups, rnd).state
        mine = client.export_state()
        for cid in range(3):
            base = int(state["held_round"][cid])
            kinds = ("mu", "bias") if cfg.dturbo.transmission.biases == "as_mu" else ("mu",)
            if base < 0:
                assert all(not state[f"held_{k}.{i.name}"][cid].any() for i in server.layers for k in kinds)
                continue
            slot = mine[f"support_rounds/{cid}"].tolist().index(base)
            for info in server.layers:
                for k in kinds:
                    assert np.array_equal(state[f"held_{k}.{info.name}"][cid], mine[f"{info.name}.{k}{slot}/{cid}"])
                    assert state[f"held_{k}.{info.name}"][cid].any()
    assert state["held_round"].tolist() == [3, 3, 3]


def test_a_client_without_the_weights_refuses_the_update_clearly(halves):
    cfg, fed, server, client = halves
    state = server.init()
    down = server.downlinks(state, 0, [0, 1])
    state = server.aggregate(state, [client.fit(down[c], fed.clients[c], c) for c in (0, 1)], 0).state
    second = server.downlinks(state, 1, [0])[0]
    fresh = DturboClient(cfg, client.model_factory)
    # supports whole (a long warm-up): only the weights are missing
    fresh.supports.keep(0, 0, [np.ones(i.grid, bool) for i in fresh.layers])
    with pytest.raises(MessageError, match="update from the weights of round 0, and this client holds none"):
        fresh.fit(second, fed.clients[0], 0)
    again = DturboClient(cfg, client.model_factory)
    again.import_state(client.export_state())  # the weights travel through the client's state
    assert again.fit(second, fed.clients[0], 0) == client.fit(second, fed.clients[0], 0)
    bad = {k: (v.astype(np.float64) if ".mu" in k else v) for k, v in client.export_state().items()}
    with pytest.raises(ValueError, match="float32"):
        again.import_state(bad)


# ---------------------------------------------------------------------------------------------- runs
def test_an_update_run_learns_on_fewer_bits(tmp_path, toy):
    """At 4 bits the update costs about half the values of 8-bit mu_G (with each layer's scale and symbol header,
    large beside this toy's few hundred weights) and the run still learns as well (within 5 points)."""
    Simulator(parse_config(config(toy, down_mu="values", down_bits=8)), tmp_path / "v8").run()
    Simulator(parse_config(config(toy)), tmp_path / "u4").run()
    v8, u4 = rows_of(tmp_path / "v8"), rows_of(tmp_path / "u4")
    assert sum(int(r["down_values_bits"]) for r in u4) < 0.65 * sum(int(r["down_values_bits"]) for r in v8)
    assert float(u4[-1]["accuracy"]) > float(v8[-1]["accuracy"]) - 0.05
    assert float(u4[-1]["accuracy"]) > 0.5


# the update on 4-bit max levels; signs both ways, whose clients keep their residuals (tests/test_up_feedback.py)
# signs or ternary values down once the support has settled (round 3 of these 5 or 6)
# and the biases as mu travels, on the clipped levels rounded to the nearest and then signs
LEVELS_AND_SIGNS = pytest.mark.parametrize(
    "transmission", [{}, {"up_bits": 1, "up_quantizer": "sign", "down_quantizer": "sign"},
                     {"down_quantizer": "settled_sign"}, {"down_quantizer": "settled_ternary", "down_share": 0.2},
                     {"down_quantizer": "settled_sign", "biases": "as_mu", "down_rounding": "nearest"}],
    ids=["levels", "signs", "settled_signs", "settled_ternary", "settled_signs_biases_nearest"])


@LEVELS_AND_SIGNS
def test_a_resumed_update_run_equals_an_uninterrupted_one(tmp_path, toy, transmission):
    """The weights each client holds (and with signs up its residual) are in the checkpoint (server and clients),
    through sampling and drops."""
    cfg = config(toy, 6, federation={"clients_per_round": 3, "min_clients": 1, "max_retries": 5},
                 faults={"drop_prob": 0.25}, transmission=transmission)
    cut_and_resume(cfg, tmp_path / "whole", tmp_path / "part", cut=3)
    assert rows_of(tmp_path / "part") == rows_of(tmp_path / "whole")
    assert_same_model(tmp_path / "part", tmp_path / "whole")


@LEVELS_AND_SIGNS
def test_on_flower_an_update_run_is_the_simulators(tmp_path, toy, transmission):
    """The ClientApp keeps the weights (and residuals) in the node's state: the Flower run directory equals the
    Simulator's."""
    pytest.importorskip("flwr", reason="flwr is not installed (pip install -e '.[flower]')")
    sim, flower = flower_and_simulator(config(toy, 5, federation={"clients_per_round": 3},
                                              transmission=transmission), tmp_path)
    assert rows_of(flower) == rows_of(sim)
    assert_same_model(flower, sim)


# ------------------------------------------------------------------------------ the levels of an update
def _heavy(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """An update as training makes it: most values small, a few tens of times larger (Student's t, 2.5 dof)."""
    return rng.standard_t(2.5, size=shape)


def test_clipped_levels_need_an_update_and_norm_levels_two_bits():
    TransmissionConfig(down_mu="update", down_quantizer="clipped", up_quantizer="norm", up_bits=2)
    with pytest.raises(ValidationError, match="down_quantizer = 'clipped' needs down_mu = 'update'"):
        TransmissionConfig(down_quantizer="clipped")
    with pytest.raises(ValidationError, match="up_quantizer = 'norm' needs up_bits of at least 2"):
        TransmissionConfig(up_quantizer="norm", up_bits=1)


@pytest.fixture(scope="module")
def clipped(toy):
    cfg = parse_config(config(toy, down_bits=3, dturbo={"transmission": {"down_quantizer": "clipped"}}))
    return build_algorithm(cfg, build_federation(cfg))[0].messages


def _tracking(quantizer: str, rounds: int = 30, nearest: bool = False, heavy: bool = True
              ) -> tuple[np.ndarray, float, int]:
    """Error feedback at 3 bits, as :meth:`encode_update` runs it: mu_G moves by a step each round (heavy-tailed, or
    Gaussian), the client's weights by the decoded update from them. The error's norm by round, the steps' median
    norm, and the bytes of every downlink."""
    from dturbo.algorithms.dturbo.values import scheme

    values, rng = scheme(3, True, quantizer, nearest=nearest), np.random.default_rng(5)
    mu = rng.normal(size=1000)
    held = mu.astype(np.float32)
    errors, steps, sent = [], [], 0
    for t in range(rounds):
        step = 0.01 * (_heavy(rng, mu.shape) if heavy else rng.normal(size=mu.shape))
        mu, steps = mu + step, steps + [np.linalg.norm(step)]
        payload = values.encode(mu - held, np.random.default_rng(t))
        held = (held + values.decode(payload, mu.size, "mu")).astype(np.float32)
        errors.append(np.linalg.norm(held - mu))
        sent += len(payload)
    return np.array(errors), float(np.median(steps)), sent


def test_a_clipped_downlink_keeps_the_weights_held_near_a_heavy_tailed_mu_g():
    """Levels clipped at 3 root mean squares keep the error of what a client holds within a few of mu_G's steps
    in every one of 30 rounds, and below the max levels' error on average and at worst: a few large values no longer
    spread the levels so far that rounding the small ones costs more than they carry."""
    clip, step, _ = _tracking("clipped")
    most, _, _ = _tracking("max")
    assert clip.max() < 2.5 * step, (clip, step)
    assert clip.mean() < most.mean() and clip.max() < most.max()


@pytest.mark.parametrize("heavy", [True, False], ids=["heavy_tailed", "gaussian"])
def test_nearest_rounding_tracks_mu_g_as_closely_on_fewer_bytes(heavy):
    """``down_rounding = "nearest"`` on the clipped levels (7 at 3 bits, 0 among them): what a client holds stays as
    near mu_G as with stochastic rounding on 8 (within 10% on the mean error over 30 rounds, below 2.5 steps at
    worst), and the downlinks, range-coded, take at least 8% fewer bytes, counted from the payloads."""
    near, step, near_bytes = _tracking("clipped", nearest=True, heavy=heavy)
    stochastic, _, stochastic_bytes = _tracking("clipped", heavy=heavy)
    assert near.mean() < 1.1 * stochastic.mean() and near.max() < 2.5 * step, (near, stochastic, step)
    assert near_bytes < 0.92 * stochastic_bytes, (near_bytes, stochastic_bytes)


def test_nearest_rounding_is_each_values_nearest_level():
    """2**bits - 1 levels over [-scale, scale], 0 among them: every value decodes to its nearest level (error at most
    half a spacing), 0 to 0 exactly, the same symbols whatever the generator; ``nearest`` only rounds clipped
    levels, with enough bits to tell them from a settled scheme's."""
    from dturbo.quantize import decode_stochastic, encode_stochastic, level_count

    v = np.random.default_rng(4).normal(size=500)
    v[:7] = 0.0
    a = encode_stochastic(v, 3, np.random.default_rng(0), coded=True, clip=3.0, nearest=True)
    assert a == encode_stochastic(v, 3, np.random.default_rng(1), coded=True, clip=3.0, nearest=True)
    out = decode_stochastic(a, 3, v.size, coded=True, nearest=True)
    scale = float(np.float32(min(np.abs(v).max(), 3.0 * np.sqrt(np.mean(v * v)))))
    inside = np.abs(v) <= scale
    assert level_count(3, nearest=True) == 7 and np.unique(out).size <= 7 and not out[:7].any()
    assert np.abs(out - v)[inside].max() <= scale / 6 * (1 + 1e-9)
    TransmissionConfig(down_mu="update", down_quantizer="settled_sign", down_bits=2, down_rounding="nearest")
    with pytest.raises(ValidationError, match="down_rounding = 'nearest' rounds the clipped levels"):
        TransmissionConfig(down_mu="update", down_quantizer="max", down_rounding="nearest")
    with pytest.raises(ValidationError, match="needs more down_bits"):
        TransmissionConfig(down_mu="update", down_quantizer="settled_ternary", down_bits=2, down_rounding="nearest")


def test_a_sign_downlink_keeps_the_weights_held_near_mu_g_on_one_bit_a_value():
    """Signs times the mean magnitude round off at most the update itself, and the next downlink sends it again: at
    one bit a value the error of what a client holds stays within a few of mu_G's steps in every one of 30 rounds,
    below what the max levels leave at 3 bits at worst."""
    sign, step, _ = _tracking("sign")
    most, _, _ = _tracking("max")
    assert sign.max() < 2.5 * step, (sign, step)
    assert sign.max() < most.max()
    with pytest.raises(ValidationError, match="down_quantizer = 'sign' needs down_mu = 'update'"):
        TransmissionConfig(down_quantizer="sign")


@pytest.mark.parametrize("quantizer, after_ramp", [("settled_sign", 2), ("settled_ternary", 3)])
def test_settled_quantizers_code_the_ramp_on_clipped_levels_and_the_rounds_after_on_their_own(toy, quantizer,
                                                                                            after_ramp):
    """``settled_sign`` / ``settled_ternary``: the downlinks of the rounds up to the one whose support first has the
    target density (round 2 of 1 warm-up and 2 ramp rounds) carry 2**3 clipped levels, later ones 2 (signs) or 3
    (ternary, a fifth of the values nonzero at ``down_share = 0.2``), and the client decodes each by its level count,
    no schedule needed: the weights it holds are the server's, bit for bit."""
    from dturbo.quantize import payload_levels

    cfg = parse_config(config(toy, down_bits=3, dturbo={"transmission": {"down_quantizer": quantizer,
                                                                          "down_share": 0.2}}))
    server, client = build_algorithm(cfg, build_federation(cfg))
    assert server.messages.settled_after == 2 and client.messages.settled_after is None
    rng = np.random.default_rng(3)
    support = rng.random((20, 30)) < 0.6
    held = (rng.normal(size=support.shape) * support).astype(np.float32)
    mu = held + 0.01 * _heavy(rng, support.shape) * support
    for rnd, levels in [(0, 8), (2, 8), (3, after_ramp), (5, after_ramp)]:
        (step,), (after,) = server.messages.encode_update(_record(mu, support, rnd), 0, [held])
        assert payload_levels(step) == levels
        decoded = client.messages.down_values.decode(step, int(support.sum()), "mu")
        assert np.array_equal(after, updated_weights(held, support, decoded))
        if levels == 3:
            assert np.count_nonzero(decoded) == int(np.ceil(0.2 * support.sum()))
    with pytest.raises(ValidationError, match=f"down_quantizer = '{quantizer}' needs down_mu = 'update'"):
        TransmissionConfig(down_quantizer=quantizer)
    with pytest.raises(ValidationError, match="'settled_sign' needs down_bits of at least 2"):
        TransmissionConfig(down_quantizer="settled_sign", down_mu="update", down_bits=1)
    with pytest.raises(ValidationError, match="down_quantizer = 'ternary' needs down_mu = 'update'"):
        TransmissionConfig(down_quantizer="ternary")
    with pytest.raises(ValidationError, match="down_share"):
        TransmissionConfig(down_share=0.0)


def test_a_clipped_downlink_sends_a_client_without_weights_the_max_levels(clipped):
    """A client that holds nothing gets mu_G itself, on the max levels: every weight within one spacing of them,
    2 max|mu_G| / (2**3 - 1), none clipped."""
    rng = np.random.default_rng(7)
    support = rng.random((20, 30)) < 0.6
    mu = _heavy(rng, support.shape) * support
    after = clipped.encode_update(_record(mu, support), 0, None)[1][0]
    assert np.abs(after[support] - mu[support]).max() <= 2 * np.abs(mu).max() / 7 * (1 + 1e-6)


def test_norm_levels_are_unbiased_and_cost_under_a_bit_a_value():
    """QSGD's levels (s = 15 at 5 bits) on a heavy-tailed update: the mean of many draws is the update (within 4
    standard errors), 0 is among the levels, and range-coded the symbols cost under a bit each, from real bytes."""
    from dturbo.algorithms.dturbo.values import scheme

    rng = np.random.default_rng(8)
    v = _heavy(rng, (4000,))
    norm5 = scheme(5, True, "norm")
    payloads = [norm5.encode(v, np.random.default_rng(i)) for i in range(400)]
    draws = np.stack([norm5.decode(p, v.size, "mu") for p in payloads])
    spacing = np.linalg.norm(v) / 15
    assert np.all(np.abs(draws.mean(0) - v) < 4 * spacing / 2 / np.sqrt(len(draws)))
    assert (draws == 0).mean() > 0.5
    assert 8 * np.mean([len(p) for p in payloads]) / v.size < 1.0


# ------------------------------------------------------------------------------------- ternary updates
def test_the_ternary_code_sends_the_largest_share_and_leaves_out_less_than_the_values():
    """STC's ternary code against brute force: the ceil(share n) values largest in magnitude (nonzero ones only) at
    their signs times their mean magnitude m, the rest 0; what it leaves out, |v|^2 - k m^2, never exceeds |v|^2;
    both writings decode to the same values, and range-coded 10% of a long vector costs under 0.7 bits a value
    (its entropy: 0.57)."""
    from dturbo.codec import CodecError
    from dturbo.quantize import decode_top_ternary, encode_sign, encode_top_ternary

    rng = np.random.default_rng(0)
    for v, share in ((rng.normal(size=1000), 0.1), (_heavy(rng, (999,)), 0.25), (np.zeros(5), 0.5),
                     (np.array([0.0, 0.0, -3.0, 0.0]), 1.0), (np.array([1.0, -2.0, 0.5]), 0.01)):
        k = min(int(np.ceil(share * v.size)), int(np.count_nonzero(v)))
        top = np.argsort(-np.abs(v), kind="stable")[:k]
        m = np.float32(np.abs(v[top]).mean()) if k else np.float32(0)
        want = np.zeros(v.size)
        want[top] = np.sign(v[top]) * float(m)
        for coded in (False, True):
            got = decode_top_ternary(encode_top_ternary(v, share, coded), v.size, coded)
            np.testing.assert_array_equal(got, want)
            assert np.sum((v - got) ** 2) == pytest.approx(np.sum(v * v) - k * float(m) ** 2, rel=1e-6, abs=1e-9)
    long = rng.normal(size=20000)
    assert 8 * len(encode_top_ternary(long, 0.1, True)) < 0.7 * long.size
    with pytest.raises(CodecError, match="ternary payload has 2 levels"):
        decode_top_ternary(encode_sign(long, True), long.size, True)
    with pytest.raises(ValueError, match="share must be in"):
        encode_top_ternary(long, 0.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_top_ternary(np.array([1.0, np.inf]), 0.5)


def test_a_ternary_downlink_keeps_the_weights_held_near_mu_g_at_a_tenth_of_the_values():
    """Sending 10% of the update a round, what a client holds lags mu_G by what is not sent yet; the next downlinks
    send it, so over 60 rounds of heavy-tailed steps the lag stays within a few steps, does not grow, and stays
    below what signs leave at worst."""
    ternary, step, _ = _tracking("ternary", 60)
    sign, _, _ = _tracking("sign", 60)
    assert ternary.max() < 2.5 * step, (ternary, step)
    assert ternary[30:].mean() < 1.1 * ternary[:30].mean()
    assert ternary.max() < sign.max()


# ------------------------------------------------------------------------------- biases = "as_mu"
def test_biases_as_mu_need_levels_up_not_signs():
    TransmissionConfig(biases="as_mu", up_quantizer="norm", up_bits=5)
    with pytest.raises(ValidationError, match="biases = 'as_mu' needs up_quantizer 'max' or 'norm'"):
        TransmissionConfig(biases="as_mu", up_quantizer="sign", up_bits=1)


def _one_round(toy: Path, biases: str) -> tuple[dict, dict, dict, list]:
    """One client's round on the toy: the server's state after it, per layer the biases the client started from
    (its downlink's) and those it trained, and its upload's fields."""
    from dturbo.codec import decode_message

    cfg = parse_config(config(toy, 4, down_bits=3, federation={"clients": 1},
                              transmission={"down_quantizer": "clipped", "biases": biases}))
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    state = server.init()
    down = server.downlinks(state, 0, [0])[0]
    start = {i.name: d.bias.astype(np.float64)
             for i, d in zip(client.layers, client.messages.decode_downlink(down).layers, strict=True)}
    up = client.fit(down, fed.clients[0], 0)
    trained = {n: layer.bias.detach().numpy().astype(np.float64) for n, layer in client.model.named_modules()
               if n in start}
    return server.aggregate(state, [up], 0).state | {f"{n}.start": b for n, b in start.items()}, \
        state, trained, decode_message(up)[1]


def test_biases_as_mu_move_the_servers_biases_by_the_update_on_fewer_bytes(toy):
    """With one client, float16 biases up make the server's biases the client's trained ones (within float16's
    rounding); as mu travels the server adds the client's update, trained - received, to its own (within one level
    spacing of it, 2 max|update| / (2**4 - 1) at 4 bits), so the downlink's rounding never enters them; and the
    upload's bias fields are smaller than float16's, from the real bytes."""
    sizes = {}
    for biases in ("float16", "as_mu"):
        after, before, trained, fields = _one_round(toy, biases)
        for name, bias in trained.items():
            got = after[f"{name}.bias"].astype(np.float64)
            if biases == "float16":
                assert np.abs(got - bias).max() <= 1e-3 * np.abs(bias).max(), name
                continue
            update = bias - after[f"{name}.start"]
            moved = got - before[f"{name}.bias"]
            assert np.abs(moved - update).max() <= 2 * np.abs(update).max() / (2**4 - 1) * (1 + 1e-6), name
            assert np.abs(update).max() > 0
        sizes[biases] = sum(len(p) for n, p in fields if n.endswith(".bias"))
    assert sizes["as_mu"] < 0.6 * sizes["float16"], sizes


def test_biases_as_mu_learn_on_fewer_bits(tmp_path, toy):
    """A run with the biases as mu travels (the update down from what each client holds, on the clipped levels,
    then signs) books fewer bits in each direction than with float16 biases, and learns as well (within 5 points)."""
    rows = {}
    for biases in ("float16", "as_mu"):
        cfg = config(toy, down_bits=3, transmission={"down_quantizer": "settled_sign", "biases": biases})
        Simulator(parse_config(cfg), tmp_path / biases).run()
        rows[biases] = rows_of(tmp_path / biases)
    for d in ("up", "down"):
        assert (sum(int(r[f"{d}_bits"]) for r in rows["as_mu"])
                < sum(int(r[f"{d}_bits"]) for r in rows["float16"])), d
    assert float(rows["as_mu"][-1]["accuracy"]) > float(rows["float16"][-1]["accuracy"]) - 0.05


@pytest.mark.parametrize("positions", ["full", "delta"])
def test_biases_as_mu_travel_down_as_values_on_the_downlinks_levels(toy, positions):
    """``down_mu = "values"``: the biases travel as mu_G does, as values on 2**8 max levels, each within one level
    spacing (2 max|b| / 255) of the server's, in fewer bytes than float16."""
    from dturbo.codec import decode_message

    sizes = {}
    for biases in ("float16", "as_mu"):
        cfg = parse_config(config(toy, 4, down_mu="values", down_bits=8, federation={"clients": 2},
                                  transmission={"positions": positions, "biases": biases}))
        server, client = build_algorithm(cfg, build_federation(cfg))
        state = server.init()
        down = server.downlinks(state, 0, [0, 1])[0]
        for info, layer in zip(client.layers, client.messages.decode_downlink(down).layers, strict=True):
            bias = state[f"{info.name}.bias"]
            assert np.abs(layer.bias - bias).max() <= 2 * np.abs(bias).max() / 255 * (1 + 1e-6) + 1e-7
        sizes[biases] = sum(len(p) for n, p in decode_message(down)[1] if n.endswith(".bias"))
    assert sizes["as_mu"] < 0.75 * sizes["float16"], sizes

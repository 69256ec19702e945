"""``[dturbo.transmission] positions = "delta"`` (docs/communication.md, "Positions"): each client's downlink codes
the support as the positions that flipped since the support that client holds. The coding is lossless, so a run
is the same run as with full positions, bit for bit, but for the downlink's bits; the server knows what each client
holds through client sampling, faults and a resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from run_helpers import cut_and_resume, flower_and_simulator, rows_of
from safetensors.numpy import load_file

from dturbo.algorithms.base import MessageError, message_bits
from dturbo.algorithms.dturbo import DturboClient
from dturbo.algorithms.registry import build_algorithm
from dturbo.codec import (
    CodecError,
    decode_support_delta,
    encode_support,
    encode_support_delta,
    payload_bits,
)
from dturbo.federation import build_federation
from dturbo.settings import parse_config
from dturbo.sim import Simulator

# the columns allowed to differ between a "full" and a "delta" run: the downlink's bits and the times
DOWN = {"down_bits", "cum_bits", "down_headers_bits", "down_positions_bits", "down_values_bits"}


# ------------------------------------------------------------------------------------------ the coding
def _supports() -> list[tuple[str, np.ndarray, np.ndarray | None]]:
    rng = np.random.default_rng(7)
    s = rng.random((20, 30)) < 0.15
    few = s ^ (rng.random(s.shape) < 0.01)
    many = s ^ (rng.random(s.shape) < 0.4)
    return [
        ("no base", s, None),
        ("empty from empty", np.zeros((5, 7), bool), np.zeros((5, 7), bool)),
        ("empty from random", np.zeros_like(s), s),
        ("full from random", np.ones_like(s), s),
        ("full from full", np.ones((4, 9), bool), np.ones((4, 9), bool)),
        ("identical", s, s.copy()),
        ("all flipped", ~s, s),
        ("a few flipped", few, s),
        ("many flipped", many, s),
        ("one row", rng.random((1, 50)) < 0.3, rng.random((1, 50)) < 0.3),
        ("one weight", np.ones((1, 1), bool), np.zeros((1, 1), bool)),
    ]


@pytest.mark.parametrize("name,support,base", _supports(), ids=[c[0] for c in _supports()])
def test_support_delta_round_trip_and_bound(name, support, base):
    data = encode_support_delta(support, base)
    assert np.array_equal(decode_support_delta(data, base), support)
    # never more than the full positions and the flag byte
    assert len(data) <= 1 + len(encode_support(support))
    parts = payload_bits(data, "support_delta")
    assert sum(parts.values()) == 8 * len(data) and parts["values"] == 0


def test_support_delta_is_small_when_little_changes():
    rng = np.random.default_rng(1)
    base = rng.random((120, 256)) < 0.12
    new = base.copy()
    new.reshape(-1)[rng.choice(new.size, 30, replace=False)] ^= True
    data = encode_support_delta(new, base)
    assert data[0] & 3 == 1  # the flips, not the whole support
    assert 8 * len(data) < 30 * 16 < 8 * len(encode_support(new)) / 10


def test_support_delta_refuses_what_it_cannot_read():
    base = np.eye(6, dtype=bool)
    delta = encode_support_delta(~base, base)
    with pytest.raises(ValueError, match="needs the support"):
        decode_support_delta(delta, None)
    for bad in (b"", bytes([7]) + delta[1:], delta[:1], delta + b"\0"):
        with pytest.raises(CodecError):
            decode_support_delta(bad, base)


# ---------------------------------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(600)


def config(toy: Path, positions: str, rounds: int = 6, **sections) -> dict:
    """The frontier's transmission (up 4, down 8 bits, sigma_prior rebuilt) on a small mlp, pruned in 3 rounds."""
    cfg = {
        "experiment": {"seed": 3, "rounds": rounds, "threads": 1},
        "data": {"name": "npz", "path": str(toy)},
        "federation": {"clients": 4, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [48]},
        "train": {"local_steps": 3, "batch_size": 32, "lr": 0.01},
        "dturbo": {"sparsity": {"target_density": 0.3, "warmup_rounds": 1, "ramp_rounds": 2},
                   "transmission": {"up_bits": 4, "down_bits": 8, "prior_std": "rebuilt", "positions": positions}},
    }
    for key, value in sections.items():
        if key == "transmission":
            cfg["dturbo"]["transmission"] |= value
        else:
            cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def events(out: Path) -> str:
    return (out / "events.log").read_text() if (out / "events.log").exists() else ""


def assert_same_model(a: Path, b: Path) -> None:
    """The final models' tensors are equal, bit for bit (the file's metadata order may differ)."""
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def _same_but_downlink(full: Path, delta: Path) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    a, b = rows_of(full), rows_of(delta)
    assert [{k: v for k, v in r.items() if k not in DOWN} for r in a] == \
        [{k: v for k, v in r.items() if k not in DOWN} for r in b]
    assert_same_model(full, delta)
    assert events(full) == events(delta)
    for r in a + b:  # the ledger adds up per client
        assert sum(int(r[f"down_{p}_bits"]) for p in ("headers", "positions", "values")) == int(r["down_bits"])
    return a, b


@pytest.mark.parametrize("case,ratio", [
    ({}, 0.5),
    ({"federation": {"clients_per_round": 3}}, 1.0),
    ({"faults": {"drop_prob": 0.3, "corrupt_prob": 0.2}, "federation": {"min_clients": 1, "max_retries": 5}}, 1.0),
    ({"transmission": {"down_bits": 16}}, 0.5),
], ids=["every client", "sampling", "faults", "float16 down"])
def test_delta_is_the_same_run_with_fewer_position_bits(tmp_path, toy, case, ratio):
    """Accuracy, loss, density, every figure but the downlink's bits, the events and the final model: identical.
    Once the schedule ends (round 4 on) the positions cost less (under half with every client every round; less
    where clients that missed a round get the whole support); a downlink never costs more than with full
    positions plus a flag byte per layer."""
    Simulator(parse_config(config(toy, "full", **case)), tmp_path / "full").run()
    Simulator(parse_config(config(toy, "delta", **case)), tmp_path / "delta").run()
    full, delta = _same_but_downlink(tmp_path / "full", tmp_path / "delta")
    if "down_bits" not in case.get("transmission", {}):  # (float16 "full" is mu cluster-coded, another format)
        for f, d in zip(full, delta, strict=True):
            # per downlink: a flag byte and a longer field length per layer, the base round in meta (8 bytes)
            layers = sum(k.startswith("density_") for k in d)
            sent = int(d["participants"]) * (int(d["retries"]) + 1)
            assert int(d["down_bits"]) <= int(f["down_bits"]) + sent * (16 * layers + 64)
    settled = slice(4, None)
    assert sum(int(r["down_positions_bits"]) for r in delta[settled]) < \
        ratio * sum(int(r["down_positions_bits"]) for r in full[settled])
    assert int(delta[-1]["down_bits"]) < int(full[-1]["down_bits"])


def test_a_resumed_delta_run_equals_an_uninterrupted_one(tmp_path, toy):
    """What each client holds is in the checkpoint (server and clients): cut after round 3, resume, same run."""
    cfg = config(toy, "delta", 6, federation={"clients_per_round": 3, "min_clients": 1, "max_retries": 5},
                 faults={"drop_prob": 0.25})
    cut_and_resume(cfg, tmp_path / "whole", tmp_path / "part", cut=3)
    assert rows_of(tmp_path / "part") == rows_of(tmp_path / "whole")
    assert_same_model(tmp_path / "part", tmp_path / "whole")


# ----------------------------------------------------------------------------- server and client alone
@pytest.fixture
def halves(toy):
    """Server and client halves with a support that stays whole (long warm-up): every delta is empty."""
    cfg = parse_config(config(toy, "delta", 4, federation={"clients": 3},
                              dturbo={"sparsity": {"target_density": 0.3, "warmup_rounds": 4, "ramp_rounds": 1}}))
    fed = build_federation(cfg)
    server, client = build_algorithm(cfg, fed)
    return cfg, fed, server, client


def test_stale_clients_get_the_whole_support_and_a_delta_needs_its_base(halves):
    cfg, fed, server, client = halves
    state = server.init()
    first = server.downlinks(state, 0, [0, 1, 2])
    assert first[0] == first[1] == first[2] == server.downlink(state, 0)  # nobody holds a support yet
    ups = [client.fit(first[c], fed.clients[c], c) for c in (0, 1)]  # client 2 misses the round
    state = server.aggregate(state, ups, 0).state
    assert state["held_round"].tolist() == [0, 0, -1]
    second = server.downlinks(state, 1, [0, 1, 2])
    assert second[0] is second[1]  # one base, one message
    assert second[2] == server.downlink(state, 1)  # the stale client: whole supports
    assert len(second[0]) < len(second[2])
    bits = message_bits(second[0], server.layouts)
    assert bits["positions"] < message_bits(second[2], server.layouts)["positions"]
    # a client that does not hold the base (a fresh process, state lost) refuses the delta clearly ...
    with pytest.raises(MessageError, match="difference from the support of round 0.*holds no support"):
        DturboClient(cfg, client.model_factory).fit(second[0], fed.clients[0], 0)
    # ... and one that holds another round's names it
    other = DturboClient(cfg, client.model_factory)
    other.import_state({k: v for k, v in client.export_state().items() if k.endswith("/2")})
    assert other.export_state() == {}
    # the same downlink is read by a client holding round 0's support, also after a trip through its state
    again = DturboClient(cfg, client.model_factory)
    again.import_state(client.export_state())
    assert again.fit(second[0], fed.clients[0], 0) == client.fit(second[0], fed.clients[0], 0)


def test_a_client_keeps_the_two_newest_supports(halves):
    """A retried round (or a resumed one the client had already decoded) is coded against the support before it."""
    cfg, fed, server, client = halves
    state = server.init()
    for rnd in range(3):
        down = server.downlinks(state, rnd, [0, 1])
        ups = [client.fit(down[c], fed.clients[c], c) for c in (0, 1)]
        if rnd == 1:  # the round again: the client holds rounds 0 and 1, the server still knows round 0
            assert client.fit(down[0], fed.clients[0], 0) == ups[0]
        state = server.aggregate(state, ups, rnd).state
    assert client.export_state()["support_rounds/0"].tolist() == [1, 2]
    with pytest.raises(ValueError, match="bytes"):
        client.import_state({"support_rounds/0": np.array([1]), **{
            f"{i.name}.support0/0": np.zeros(1, np.uint8) for i in client.layers}})


def test_on_flower_each_client_gets_its_own_message_and_the_run_is_the_simulators(tmp_path, toy):
    """The ServerApp sends each SuperNode its own downlink (client sampling: some are stale and get the whole
    support); the ClientApp keeps the supports in the node's state; the run directory equals the Simulator's."""
    pytest.importorskip("flwr", reason="flwr is not installed (pip install -e '.[flower]')")
    sim, flower = flower_and_simulator(config(toy, "delta", 5, federation={"clients_per_round": 3}), tmp_path)
    assert rows_of(flower) == rows_of(sim)
    assert_same_model(flower, sim)

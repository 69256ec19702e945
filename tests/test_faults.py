"""Faults in the simulator: dropped, late and hostile clients, too few valid updates, a poisoned state.
Rounds complete with who answered, everything is recorded, nothing saved is lost, resume stays exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from run_helpers import cut_and_resume, rows_of

from dturbo.algorithms.registry import build_algorithm
from dturbo.checkpoint import load_checkpoint
from dturbo.faults import CORRUPTIONS, corrupt, draw_faults
from dturbo.settings import parse_config
from dturbo.sim import PoisonedStateError, Simulator, TooFewClientsError, check_finite


@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(800)


def config(toy: Path, rounds: int = 5, **sections) -> dict:
    cfg = {
        "experiment": {"seed": 4, "rounds": rounds, "threads": 1},
        "data": {"name": "npz", "path": str(toy)},
        "federation": {"clients": 8, "alpha": 1.0},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"local_steps": 5, "lr": 0.01},
        "dturbo": {"beta": 0.01, "sparsity": {"target_density": 0.4, "warmup_rounds": 1, "ramp_rounds": 3}},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


HOSTILE = {"drop_prob": 0.2, "corrupt_prob": 0.3, "straggler_sigma": 0.6, "deadline": 1.6}


@pytest.mark.parametrize("algorithm", ["dturbo", "dssm"])
def test_rounds_complete_with_who_answered_and_every_fault_is_recorded(tmp_path, toy, algorithm):
    cfg = parse_config(config(toy, 6, faults=HOSTILE, experiment={"algorithm": algorithm},
                              federation={"min_clients": 2, "max_retries": 5}))
    rows = Simulator(cfg, tmp_path / "run").run()
    assert len(rows) == 6
    events = (tmp_path / "run" / "events.log").read_text().splitlines()
    total = {k: sum(int(r[k]) for r in rows) for k in ("clients_dropped", "clients_late", "clients_corrupted")}
    assert all(v > 0 for v in total.values()), total  # every kind of fault happened ...
    # ... and no corrupt upload got in
    assert sum(int(r["clients_rejected"]) for r in rows) == total["clients_corrupted"]
    for r in rows:
        ok = int(r["participants"]) - sum(int(r[k]) for k in ("clients_dropped", "clients_late", "clients_failed",
                                                                   "clients_rejected"))
        assert int(float(r["clients_ok"])) == ok >= 2
    assert any("upload rejected" in e for e in events) and any("deadline" in e for e in events)
    # the ledger still adds up with the faulty traffic
    for r in rows:
        assert sum(int(r[f"up_{p}_bits"]) for p in ("headers", "positions", "values")) == int(r["up_bits"])


def test_resume_under_faults_is_exact(tmp_path, toy):
    cfg = config(toy, 6, faults=HOSTILE, federation={"min_clients": 2, "max_retries": 5})
    cut_and_resume(cfg, tmp_path / "full", tmp_path / "part", cut=3)
    assert rows_of(tmp_path / "part") == rows_of(tmp_path / "full")
    assert (tmp_path / "part" / "events.log").read_text() == (tmp_path / "full" / "events.log").read_text()


def test_too_few_clients_retries_then_completes(tmp_path, toy):
    cfg = parse_config(config(toy, 4, faults={"drop_prob": 0.6},
                              federation={"min_clients": 4, "on_too_few": "retry", "max_retries": 20}))
    rows = Simulator(cfg, tmp_path / "run").run()
    assert sum(int(r["retries"]) for r in rows) > 0
    assert all(int(float(r["clients_ok"])) >= 4 for r in rows)
    assert "fewer than federation.min_clients = 4" in (tmp_path / "run" / "events.log").read_text()


def test_too_few_clients_stops_clearly_and_keeps_what_was_saved(tmp_path, toy):
    cfg = parse_config(config(toy, 8, faults={"drop_prob": 0.7},
                              federation={"min_clients": 4, "on_too_few": "stop"}))
    out = tmp_path / "run"
    with pytest.raises(TooFewClientsError, match="min_clients = 4.*--resume"):
        Simulator(cfg, out).run()
    done = len(rows_of(out)) if (out / "metrics.csv").exists() else 0
    if done:
        _, counters = load_checkpoint(out / "checkpoint")
        assert counters["rounds_done"] == done
    assert f"round {done + 1}: attempt 1:" in (out / "events.log").read_text()


def test_a_poisoned_state_is_never_checkpointed(tmp_path, toy):
    cfg = parse_config(config(toy, 4))
    sim = Simulator(cfg, tmp_path / "run")
    real = sim.server.aggregate

    def poisoned(state, uplinks, rnd, senders=None):
        result = real(state, uplinks, rnd, senders)
        if rnd == 2:
            result.state["dense1.mu"] = result.state["dense1.mu"].copy()
            result.state["dense1.mu"][0, 0] = np.nan
        return result

    sim.server.aggregate = poisoned  # type: ignore[method-assign]
    with pytest.raises(PoisonedStateError, match="dense1.mu"):
        sim.run()
    state, counters = load_checkpoint(tmp_path / "run" / "checkpoint")
    assert counters["rounds_done"] == 2 and len(rows_of(tmp_path / "run")) == 2
    check_finite(state, 3)  # the saved state is clean


def test_every_corruption_is_rejected_by_the_server(toy):
    cfg = parse_config(config(toy))
    from dturbo.federation import build_federation

    fed = build_federation(cfg)
    for algorithm in ("dturbo", "fedavg", "fedpaq", "dssm"):
        cfg.experiment.algorithm = algorithm
        server, client = build_algorithm(cfg, fed)
        state = server.init()
        good = client.fit(server.downlink(state, 0), fed.clients[0], 0)
        for rnd, how in enumerate(CORRUPTIONS * 4):
            bad = corrupt(good, how, rnd, 1)
            result = server.aggregate(state, [good, bad], 0)
            assert result.metrics["clients_rejected"] == 1, (algorithm, how)


def test_fault_draws_are_seeded_and_have_the_asked_rates(toy):
    cfg = parse_config(config(toy, faults={"drop_prob": 0.25, "corrupt_prob": 0.0}))
    clients = list(range(400))
    a = draw_faults(cfg, 3, 0, clients)
    assert a == draw_faults(cfg, 3, 0, clients)
    assert a != draw_faults(cfg, 3, 1, clients)  # a retried round meets other faults
    assert 0.18 < len(a) / 400 < 0.32 and set(a.values()) == {"drop"}
    assert draw_faults(parse_config(config(toy)), 3, 0, clients) == {}


def test_a_stale_or_replayed_upload_is_rejected(toy):
    cfg = parse_config(config(toy))
    from dturbo.algorithms.base import MessageError
    from dturbo.federation import build_federation

    fed = build_federation(cfg)
    for algorithm in ("dturbo", "fedavg"):
        cfg.experiment.algorithm = algorithm
        server, client = build_algorithm(cfg, fed)
        state = server.init()
        old = client.fit(server.downlink(state, 0), fed.clients[0], 0)
        fresh = client.fit(server.downlink(state, 1), fed.clients[1], 1)
        result = server.aggregate(state, [old, fresh], 1)
        assert result.metrics["clients_ok"] == 1 and "stale or replayed" in result.rejected[0]
        with pytest.raises(MessageError, match="no valid client update"):
            server.aggregate(state, [old], 1)

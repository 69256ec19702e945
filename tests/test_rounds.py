"""One round path for every runner (dturbo.rounds): the Flower Strategy in a user's app accepts, books and retries
a round as the simulator does. Hostile or failing ClientApps here answer the strategy's train messages over an
in-process Flower grid; the server must refuse what the simulator refuses."""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install -e '.[flower]')")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict  # noqa: E402
from test_flower_strategy import CLIENTS, TinyNet, runner_config, user_client_app  # noqa: E402

import dturbo.flower as dflower  # noqa: E402
from dturbo.algorithms.base import pack_scalars, unpack_scalars  # noqa: E402
from dturbo.codec import decode_message, encode_message  # noqa: E402
from dturbo.flower import wire  # noqa: E402
from dturbo.flower.inprocess import InProcessGrid  # noqa: E402
from dturbo.rounds import TooFewClientsError  # noqa: E402

Rewrite = Callable[[int, bytes, Message], Message | None]


def app_with(rewrite: Rewrite) -> Callable[[Message, Context], Message]:
    """The user's honest ClientApp, whose train replies ``rewrite(partition-id, upload, reply)`` may replace."""
    honest = user_client_app()

    def app(msg: Message, context: Context) -> Message:
        reply = honest(msg, context)
        if msg.metadata.message_type == "train" and wire.UP in reply.content.array_records:
            changed = rewrite(context.node_config["partition-id"], wire.record_bytes(reply.content, wire.UP), reply)
            return changed if changed is not None else reply
        return reply

    return app


def with_upload(reply: Message, upload: bytes) -> Message:
    content = reply.content
    content.array_records[wire.UP] = wire.bytes_record(upload)
    return reply


def run(app: Callable[[Message, Context], Message], rounds: int = 2, **federation: object
        ) -> tuple[dflower.DturboStrategy, object]:
    cfg = runner_config("dturbo", rounds=rounds)
    cfg["federation"] = {**cfg["federation"], **federation}
    strategy = dflower.DturboStrategy(TinyNet, algorithm="dturbo", config=cfg, fraction_evaluate=0.0)
    result = strategy.start(grid=InProcessGrid(app, CLIENTS), initial_arrays=ArrayRecord(), num_rounds=rounds)
    return strategy, result


def with_meta(reply: Message, upload: bytes, client: int | None = None, n_t: int | None = None) -> Message:
    """``reply`` with its upload's header claiming another client id or sample count."""
    kind, fields = decode_message(upload)
    round_idx, own, own_n = unpack_scalars(dict(fields)["meta"], 3)
    meta = pack_scalars([round_idx, own if client is None else client, own_n if n_t is None else n_t])
    return with_upload(reply, encode_message(kind, [(n, meta if n == "meta" else p) for n, p in fields]))


def test_a_spoofed_upload_is_refused_by_the_strategy() -> None:
    """Client 0 sends its upload under client 1's id: the strategy knows who sent it and refuses it."""
    _, result = run(app_with(lambda pid, up, reply: with_meta(reply, up, client=1) if pid == 0 else None))
    for m in result.train_metrics_clientapp.values():
        assert m["clients_rejected"] == 1 and m["clients_ok"] == CLIENTS - 1


def test_an_upload_claiming_more_samples_than_its_node_holds_is_refused() -> None:
    """The nodes' answers to the sample query are their partitions: an upload claiming more is refused."""
    strategy, result = run(app_with(lambda pid, up, reply: with_meta(reply, up, n_t=10_000) if pid == 2 else None))
    assert strategy.session.server.partitions == [200, 200, 200]
    assert all(m["clients_rejected"] == 1 for m in result.train_metrics_clientapp.values())


def test_an_oversized_reply_is_booked_at_the_bound_and_refused() -> None:
    honest_up: list[int] = []

    def huge(pid: int, upload: bytes, reply: Message) -> Message | None:
        if pid != 1:
            honest_up.append(len(upload))
            return None
        return with_upload(reply, upload + bytes(10 * len(upload) + 100_000))

    strategy, result = run(app_with(huge), rounds=1)
    bound = strategy.session.server.max_uplink_bytes
    m = result.train_metrics_clientapp[1]
    assert m["clients_rejected"] == 1
    assert m["up_bits"] == 8 * (bound + sum(honest_up))


def failing(calls: list[int]) -> Callable[[Message, Context], Message]:
    """A ClientApp whose every training fails (a ClientError's failure record), counting the train messages."""
    honest = user_client_app()

    def app(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type != "train":
            return honest(msg, context)
        calls.append(context.node_config["partition-id"])
        task = wire.task_record(msg.content)
        failure = ConfigRecord({"client": int(task["client"]), "round": int(task["round"]), "reason": "diverged"})
        return Message(RecordDict({wire.FAILURE: failure}), reply_to=msg)

    return app


def test_a_round_without_a_valid_upload_stops_the_strategy() -> None:
    calls: list[int] = []
    with pytest.raises(TooFewClientsError, match="round 1: fewer than federation.min_clients = 1") as err:
        run(failing(calls), on_too_few="stop")
    assert sorted(calls) == [0, 1, 2] and err.value.attempts == 1
    assert any("diverged" in event for event in err.value.events)


def test_a_round_without_a_valid_upload_is_sent_again_then_stops() -> None:
    calls: list[int] = []
    with pytest.raises(TooFewClientsError, match="after 3 attempt"):
        run(failing(calls), on_too_few="retry", max_retries=2)
    assert sorted(calls) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_a_retried_round_counts_its_retries_and_every_attempts_bits() -> None:
    """Every client fails its first train message; the round's second attempt completes it."""
    seen: set[tuple[int, int]] = set()
    honest = user_client_app()

    def flaky(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == "train":
            task = wire.task_record(msg.content)
            key = (int(task["client"]), int(task["round"]))
            if key not in seen:
                seen.add(key)
                failure = ConfigRecord({"client": key[0], "round": key[1], "reason": "busy"})
                return Message(RecordDict({wire.FAILURE: failure}), reply_to=msg)
        return honest(msg, context)

    _, result = run(flaky, rounds=1)
    m = result.train_metrics_clientapp[1]
    assert m["retries"] == 1 and m["clients_ok"] == CLIENTS and m["clients_failed"] == 0
    _, clean = run(user_client_app(), rounds=1)
    c = clean.train_metrics_clientapp[1]
    assert m["down_bits"] == 2 * c["down_bits"] and m["up_bits"] == c["up_bits"]  # both attempts' downlinks
    assert m["flower_down_bytes"] == 2 * c["flower_down_bytes"]  # Flower's bytes of both attempts' messages


@pytest.mark.parametrize("attack", ["scaled_sign_flip", "alie", "ipm"])
def test_an_attack_inside_the_bounds_meets_the_strategy_as_it_meets_the_simulator(tmp_path, attack) -> None:
    """One client rewrites its update inside the bounds (the stretched sign flip; ALIE and IPM from the round's
    honest uploads), under the robust rule: the Strategy on a HostileGrid ends with the simulator's model, bit for
    bit, and refuses nothing."""
    import torch
    from test_flower_strategy import federation, run_runner

    from dturbo.flower.inprocess import HostileGrid
    from dturbo.settings import load_config

    cfg_dict = runner_config("dturbo", rounds=2)
    cfg_dict["robust"] = {"rule": "trimmed_mean", "byzantine": 1, "clip_median": 1.0}
    hostile_cfg = load_config({**cfg_dict, "faults": {"attackers": 1, "attack": attack}})
    fed = federation(cfg_dict)
    sim, rows = run_runner(hostile_cfg, fed, TinyNet, tmp_path / "sim")

    strategy = dflower.DturboStrategy(TinyNet, algorithm="dturbo", config=cfg_dict, fraction_evaluate=0.0)
    app = user_client_app(lambda pid: (fed.clients[pid].x, fed.clients[pid].y))
    grid = HostileGrid(app, CLIENTS, hostile_cfg, lambda: strategy.session.server)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=2)
    assert all(m["clients_rejected"] == 0 for m in result.train_metrics_clientapp.values())
    assert [m["cum_bits"] for m in result.train_metrics_clientapp.values()] == [float(r["cum_bits"]) for r in rows]
    final = strategy.global_model().state_dict()
    for key, value in sim.final_model.state_dict().items():
        assert torch.equal(final[key], value), key
    clean, _ = run_runner(load_config(cfg_dict), fed, TinyNet, tmp_path / "clean")  # without the attack: another
    assert any(not torch.equal(final[k], v) for k, v in clean.final_model.state_dict().items())

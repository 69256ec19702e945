"""A client algorithm's private state (STC's model copy and residual) kept in the SuperNode's ``context.state``.

Flower's deployment engine may run the ClientApp in a fresh process per message. Simulated here over the
in-process grid: before every train message the ClientApp's process cache is emptied (a new runtime, a new
client object) and the node's ``context.state`` goes through Flower's serialisation, as it does between the
SuperNode and a ClientApp process. The uploads must be byte for byte those of an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli_w

pytest.importorskip("flwr", reason="flwr is not installed (pip install -e '.[flower]')")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects  # noqa: E402
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents  # noqa: E402
from run_helpers import rows_of  # noqa: E402

from dturbo.flower import client_app as client_module  # noqa: E402
from dturbo.flower import wire  # noqa: E402
from dturbo.flower.inprocess import InProcessGrid, run_inprocess  # noqa: E402
from dturbo.settings import load_config  # noqa: E402
from dturbo.sim import Simulator  # noqa: E402

CLIENTS, ROUNDS = 3, 3


@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(400)


def write_config(folder: Path, toy: Path, algorithm: str = "stc") -> Path:
    cfg = {
        "experiment": {"name": algorithm, "seed": 2, "rounds": ROUNDS, "threads": 1, "algorithm": algorithm},
        "data": {"name": "npz", "path": str(toy)},
        "federation": {"clients": CLIENTS, "alpha": 1.0},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"local_steps": 5, "lr": 0.01, "batch_size": 32},
        "stc": {"p_up": 0.1, "p_down": 0.1},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{algorithm}.toml"
    path.write_text(tomli_w.dumps(cfg))
    return path


def serialised(state: RecordDict) -> RecordDict:
    """``state`` after a trip through Flower's serialisation."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(state).items()}
    copy = inflate_object_from_contents(state.object_id, contents)
    assert isinstance(copy, RecordDict)
    return copy


class Recorder:
    """The ClientApp behind the grid, recording train messages and uploads by (round, client). ``fresh``: every
    train message runs as in a new process (nothing cached) on a node state read back from its serialisation."""

    def __init__(self, fresh: bool) -> None:
        self.fresh = fresh
        self.messages: dict[tuple[int, int], Message] = {}
        self.ups: dict[tuple[int, int], bytes] = {}

    def __call__(self, msg: Message, context: Context) -> Message:
        if msg.metadata.message_type != wire.TRAIN:
            return client_module.app(msg, context)
        task = wire.task_record(msg.content)
        key = (int(task["round"]), int(task["client"]))
        if self.fresh:
            client_module._CACHE.clear()
            context.state = serialised(context.state)
        self.messages[key] = msg
        reply = client_module.app(msg, context)
        assert reply.has_content() and wire.UP in reply.content, f"round {key[0] + 1}, client {key[1]} failed"
        self.ups[key] = wire.record_bytes(reply.content, wire.UP)
        return reply


def test_stc_state_survives_a_fresh_process_per_message(tmp_path, toy):
    path = write_config(tmp_path, toy)
    Simulator(load_config(path), tmp_path / "sim").run()
    kept, fresh = Recorder(fresh=False), Recorder(fresh=True)
    kept_grid = InProcessGrid(kept, CLIENTS)
    run_inprocess(path, tmp_path / "kept", grid=kept_grid)
    grid = InProcessGrid(fresh, CLIENTS)
    run_inprocess(path, tmp_path / "fresh", grid=grid)

    assert len(fresh.ups) == CLIENTS * ROUNDS and fresh.ups == kept.ups
    rows = rows_of(tmp_path / "fresh")
    assert rows == rows_of(tmp_path / "sim") == rows_of(tmp_path / "kept")
    assert [float(r["clients_ok"]) for r in rows] == [CLIENTS] * ROUNDS

    # each node keeps the model copy and its own residual only (also where one client object serves every
    # node), with the state that entered its last round
    for g in (grid, kept_grid):
        for node, ctx in g.contexts.items():
            pid = g.partition_of[node]
            own = {"model", "model_round", "model_digest", f"residual/{pid}", f"residual_round/{pid}"}
            for name in (client_module.STATE, client_module.STATE_ENTERING):
                assert isinstance(ctx.state[name], ArrayRecord) and set(ctx.state[name]) == own, name
            assert ctx.state[client_module.STATE]["residual_round/" + str(pid)].numpy().tolist() == [ROUNDS - 1]
            assert ctx.state[client_module.STATE_ENTERING]["model_round"].numpy().tolist() == [ROUNDS - 2]
            assert int(ctx.state[client_module.STATE_META]["round"]) == ROUNDS - 1

    # the last round run again (a retry) in a fresh process starts from the state that entered it: same bytes
    node = grid.node_id(1)
    last = (ROUNDS - 1, 1)
    for _ in range(2):
        client_module._CACHE.clear()
        reply = client_module.app(fresh.messages[last], grid.contexts[node])
        assert wire.record_bytes(reply.content, wire.UP) == fresh.ups[last]

    # without the saved state a fresh process cannot run STC's round 2+: it fails with the reason
    client_module._CACHE.clear()
    bare = Context(run_id=1, node_id=node, node_config=dict(grid.contexts[node].node_config),
                   state=RecordDict(), run_config={})
    reply = client_module.app(fresh.messages[last], bare)
    failure = reply.content[wire.FAILURE]
    assert isinstance(failure, ConfigRecord) and "holds no copy" in str(failure["reason"])
    assert len(bare.state) == 0


def test_algorithm_without_client_state_leaves_the_node_state_alone(tmp_path, toy):
    path = write_config(tmp_path, toy, "fedavg")
    grid = InProcessGrid(Recorder(fresh=True), CLIENTS)
    run_inprocess(path, tmp_path / "fedavg", grid=grid)
    assert all(len(ctx.state) == 0 for ctx in grid.contexts.values())

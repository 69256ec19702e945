"""The Flower ClientApp: one dturbo client per SuperNode (``dturbo.flower.client_app:app``).

A SuperNode's node config names its ``partition-id`` (the client id) and optionally ``num-partitions``
(checked against ``federation.clients``) and ``data-path`` (where this machine holds the dataset; it
replaces ``data.path`` of the configuration); on Flower's simulation engine each virtual SuperNode gets
``partition-id`` and ``num-partitions`` from Flower itself. On a train message the ClientApp builds, from the
configuration text in the message, the same :class:`~dturbo.config.Config`, the federation
(:func:`dturbo.federation.build_federation`, seeded: every node computes the same split and keeps its own part)
and the client algorithm (:func:`dturbo.algorithms.registry.build_algorithm`), then answers
``client.fit(down, data, partition_id)``. What it builds is cached per process (Flower's deployment engine
starts a fresh ClientApp process per message, the in-process grid reuses one). torch and the algorithms are
imported on the first train message only, so that the discovery query of a fresh process answers fast.

Client state: a client algorithm that keeps private state between rounds (one with ``export_state`` /
``import_state``, e.g. STC's model copy and error-feedback residual) has it saved in the node's
``context.state``, which the SuperNode keeps across the messages of one run: after a successful ``fit`` its
``export_state()`` goes into the ArrayRecord :data:`STATE` (this node's own keys only, see
:func:`own_state`), the record it replaces into :data:`STATE_ENTERING` (the state that entered that round, for
a retried round) and the round and a token into the ConfigRecord :data:`STATE_META`. Before ``fit`` it is
imported, unless this process's client object made that state itself (the token matches: the in-process
grid, where one object serves every node, then goes on exactly as the in-process Simulator). Algorithms
without ``export_state`` are untouched.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tomllib
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from ..config import Config
from ..settings import parse_config
from . import wire

if TYPE_CHECKING:
    from ..algorithms.base import ClientAlgorithm, ClientData
    from ..federation import Federation

log = logging.getLogger("flwr")

app = ClientApp()


@dataclass
class ClientRuntime:
    """What the SuperNodes of one process need to answer train messages of one configuration."""

    cfg: Config
    federation: Federation
    client: ClientAlgorithm
    # partition id -> token of the client state this process's client object made for it and still holds
    synced: dict[int, str] = field(default_factory=dict)


# names in a node's context.state (the client algorithm's private state, see the module docstring)
STATE, STATE_ENTERING, STATE_META = "dturbo.client_state", "dturbo.client_state_entering", "dturbo.client_state_meta"
_PER_CLIENT_KEY = re.compile(r".*/(\d+)")

_CACHE: dict[tuple[str, str | None], ClientRuntime] = {}


def client_runtime(config_text: str, data_path: str | None = None) -> ClientRuntime:
    """Build (once per process and configuration) the configuration, the federation and the client algorithm."""
    key = (hashlib.sha256(config_text.encode()).hexdigest(), data_path)
    if key in _CACHE:
        return _CACHE[key]
    import torch

    from ..algorithms.registry import build_algorithm
    from ..federation import build_federation

    cfg = parse_config(tomllib.loads(config_text))
    if data_path is not None:
        cfg.data.path = data_path
    if cfg.experiment.threads:  # as the Simulator: reductions depend on the thread count
        torch.set_num_threads(cfg.experiment.threads)
    fed = build_federation(cfg)
    _, client = build_algorithm(cfg, fed)
    _CACHE.clear()  # one configuration at a time: a new run replaces the previous one
    _CACHE[key] = runtime = ClientRuntime(cfg, fed, client)
    return runtime


def client_data(runtime: ClientRuntime, partition_id: int, num_partitions: int | None) -> ClientData:
    """This SuperNode's part of the federation, after checking its node config against the configuration."""
    clients = runtime.cfg.federation.clients
    if num_partitions is not None and num_partitions != clients:
        raise ValueError(f"node config {wire.NUM_PARTITIONS}={num_partitions} but the configuration has "
                         f"federation.clients = {clients}")
    if not 0 <= partition_id < clients:
        raise ValueError(f"node config {wire.PARTITION_ID}={partition_id} is outside 0..{clients - 1} "
                         f"(federation.clients = {clients})")
    return runtime.federation.clients[partition_id]


@app.query(wire.PARTITION_ACTION)
def partition(msg: Message, context: Context) -> Message:
    """Tell the server which client this SuperNode is."""
    pid, num = wire.partition_of(context)
    record = ConfigRecord({wire.PARTITION_ID: pid, wire.NUM_PARTITIONS: -1 if num is None else num})
    return Message(RecordDict({wire.PARTITION: record}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run the client algorithm on this node's partition; reply with the upload bytes (or, to a calibration,
    BatchNorm statistics)."""
    from ..algorithms.base import ClientError
    from ..algorithms.statistics import answer

    pid, num = wire.partition_of(context)
    task = wire.task_record(msg.content)
    cid, rnd = int(task["client"]), int(task["round"])
    if cid != pid:
        raise ValueError(f"train message for client {cid} reached the SuperNode of partition {pid}")
    data_path = context.node_config.get(wire.DATA_PATH)
    runtime = client_runtime(str(task["config"]), None if data_path is None else str(data_path))
    data = client_data(runtime, pid, num)
    down = wire.record_bytes(msg.content, wire.DOWN)
    try:
        restore_state(runtime, context, pid, rnd)
        up = answer(runtime.client, down, data, pid)  # a training upload, or BatchNorm statistics
    except ClientError as err:  # the algorithm's own failure (e.g. diverged): a reason, not a crash
        log.warning("client %d, round %d: %s", pid, rnd + 1, err)
        failure = ConfigRecord({"client": pid, "round": rnd, "reason": str(err)})
        return Message(RecordDict({wire.FAILURE: failure}), reply_to=msg)
    save_state(runtime, context, pid, rnd)
    reply = RecordDict({wire.UP: wire.bytes_record(up), wire.TASK: ConfigRecord({"client": pid, "round": rnd})})
    return Message(reply, reply_to=msg)


# ------------------------------------------------------------------ client state in context.state
def own_state(arrays: dict[str, np.ndarray], partition_id: int) -> dict[str, np.ndarray]:
    """The entries of an ``export_state()`` that belong to this node: every key but those of the form
    ``<name>/<client id>`` of another client id (a client object of the in-process grid serves every node;
    STC's ``residual/<cid>``, ``residual_round/<cid>``)."""
    out = {}
    for key, value in arrays.items():
        m = _PER_CLIENT_KEY.fullmatch(key)
        if m is None or int(m.group(1)) == partition_id:
            out[key] = value
    return out


def restore_state(runtime: ClientRuntime, context: Context, partition_id: int, round_idx: int) -> None:
    """Before ``fit``: hand the state saved in ``context.state`` to the client algorithm, unless this process's
    client object made it itself. For a round run again (a retry), the state that entered that round.
    ClientError when the saved state does not fit the client algorithm."""
    from ..algorithms.base import ClientError

    client = runtime.client
    state = context.state
    meta = None if state is None else state.get(STATE_META)
    if not client.keeps_state or not isinstance(meta, ConfigRecord):
        return
    token, saved_round = str(meta["token"]), int(meta["round"])
    if runtime.synced.get(partition_id) == token:
        return  # this object holds that state (and has kept what it needs to run the round again)
    record = state.get(STATE_ENTERING if saved_round == round_idx else STATE)
    if not isinstance(record, ArrayRecord):
        return  # a retry of the first round this node ran: nothing entered it
    arrays = {k: a.numpy() for k, a in record.items()}
    runtime.synced.clear()  # import_state replaces the object's whole state: it holds no other node's any more
    try:
        client.import_state(arrays)
    except ValueError as err:
        raise ClientError(f"client {partition_id}: the client state saved on this SuperNode does not fit "
                          f"({err})") from None


def save_state(runtime: ClientRuntime, context: Context, partition_id: int, round_idx: int) -> None:
    """After a successful ``fit`` of ``round_idx``: this node's part of ``export_state()`` into
    ``context.state`` (the state it replaces kept as the one entering the round, unless the round was a retry)."""
    state = context.state
    if not runtime.client.keeps_state or state is None:
        return
    arrays = own_state(runtime.client.export_state(), partition_id)
    record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
    meta = state.get(STATE_META)
    if not isinstance(meta, ConfigRecord) or int(meta["round"]) != round_idx:
        # a new round: the state it replaces is the one that entered this round
        previous = state.get(STATE)
        if isinstance(previous, ArrayRecord):
            state[STATE_ENTERING] = previous
        elif STATE_ENTERING in state:
            del state[STATE_ENTERING]
    state[STATE] = record
    token = uuid.uuid4().hex
    state[STATE_META] = ConfigRecord({"round": round_idx, "token": token})
    runtime.synced[partition_id] = token

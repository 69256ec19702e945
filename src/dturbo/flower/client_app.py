"""The Flower ClientApp: one dturbo client per SuperNode (``dturbo.flower.client_app:app``).

A SuperNode's node config names its ``partition-id`` (the client id) and optionally ``num-partitions``
(checked against ``federation.clients``) and ``data-path`` (where this machine holds the dataset; it
replaces ``data.path`` of the configuration). On a train message the ClientApp builds, from the
configuration text in the message, the same :class:`~dturbo.config.Config`, the federation
(:func:`dturbo.sim.build_federation`, seeded: every node computes the same split and keeps its own part)
and the client algorithm (:func:`dturbo.sim.build_algorithm`), then answers
``client.fit(down, data, partition_id)``. What it builds is cached per process (Flower's deployment engine
starts a fresh ClientApp process per message, the in-process grid reuses one). torch and the algorithms are
imported on the first train message only, so that the discovery query of a fresh process answers fast.
"""

from __future__ import annotations

import hashlib
import logging
import tomllib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from ..config import Config, parse_config
from . import wire

if TYPE_CHECKING:
    from ..algorithms.base import ClientAlgorithm, ClientData
    from ..sim import Federation

log = logging.getLogger("flwr")

app = ClientApp()


@dataclass
class ClientRuntime:
    """What the SuperNodes of one process need to answer train messages of one configuration."""

    cfg: Config
    federation: Federation
    client: ClientAlgorithm


_CACHE: dict[tuple[str, str | None], ClientRuntime] = {}


def client_runtime(config_text: str, data_path: str | None = None) -> ClientRuntime:
    """Build (once per process and configuration) the configuration, the federation and the client algorithm."""
    key = (hashlib.sha256(config_text.encode()).hexdigest(), data_path)
    if key in _CACHE:
        return _CACHE[key]
    import torch

    from ..sim import build_algorithm, build_federation

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
    """Run the client algorithm on this node's partition; reply with the upload bytes."""
    from ..algorithms.base import ClientError

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
        up = runtime.client.fit(down, data, pid)
    except ClientError as err:  # the algorithm's own failure (e.g. diverged): a reason, not a crash
        log.warning("client %d, round %d: %s", pid, rnd + 1, err)
        failure = ConfigRecord({"client": pid, "round": rnd, "reason": str(err)})
        return Message(RecordDict({wire.FAILURE: failure}), reply_to=msg)
    reply = RecordDict({wire.UP: wire.bytes_record(up), wire.TASK: ConfigRecord({"client": pid, "round": rnd})})
    return Message(reply, reply_to=msg)

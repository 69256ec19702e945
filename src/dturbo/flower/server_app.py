"""The Flower ServerApp: the dturbo runner with Flower as its transport (``dturbo.flower.server_app:app``).

Run config (``[tool.flwr.app.config]`` in pyproject.toml, overridden with ``flwr run --run-config``):

* ``config``: path of the dturbo TOML configuration (on the machine running the ServerApp);
* ``out``: the run directory, the same files as ``dturbo run --out`` writes (relative paths are taken from
  the ServerApp process's working directory: pass absolute ones);
* ``resume`` (default false): continue the run directory's checkpoint, as ``dturbo run --resume``; ``unverified``:
  as ``--resume-unverified``;
* ``round-timeout`` (seconds, default 3600; 0 = wait for every reply): a client that has not answered by
  then counts as dropped for the round;
* ``connect-timeout`` (seconds, default 120): how long the first round waits for a SuperNode of every
  client id to connect (the round then goes on with those that did; the others count as dropped).

Client id <-> node id: each SuperNode's node config names its ``partition-id``, which IS the client id; the
server learns it with a ``query.partition`` message to every node it does not know yet (at the first round,
and later when a node joins or comes back under a new node id). A partition-id two connected nodes claim is
contested: neither node is sent that client's rounds for the rest of the run (the server cannot tell which one
is the client; Flower's node authentication binds nodes to partitions).

On Flower's simulation engine (``flwr run . <local simulation connection>``, ``flwr[simulation]``: Ray) the
SuperNodes are virtual, one per partition, every one registered before the ServerApp starts, and their node
config carries ``partition-id`` / ``num-partitions`` as a deployment's does; the same app runs unchanged. Only
the federation's size is checked first (``num-supernodes`` must equal ``federation.clients``), so that a
mismatch is an error at once instead of clients waiting ``connect-timeout`` and counting as dropped.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.app import DEFAULT_TTL, ConfigRecord, Context, Message, MessageType, RecordDict, UserConfig
from flwr.serverapp import Grid, ServerApp

from ..config import Config
from ..settings import load_config
from ..sim import Simulator
from ..transport import ClientLost, Downlinks, Reply
from . import wire

log = logging.getLogger("flwr")

app = ServerApp()

DEFAULTS: dict[str, Any] = {"resume": False, "round-timeout": 3600.0, "connect-timeout": 120.0}


class FlowerTransport:
    """The clients are Flower SuperNodes reached through a Grid: a :class:`~dturbo.transport.Transport`.

    Each selected client's downlink bytes go to its SuperNode in a train Message (one Message per client, so a
    per-client downlink costs nothing more) and the upload bytes come back in its reply. A Flower error reply or a
    missing reply becomes a :class:`~dturbo.algorithms.base.ClientError` / :class:`~dturbo.transport.ClientLost`,
    which the runner counts (``clients_failed`` / ``clients_dropped``) and
    logs (events.log) as for the in-process clients.
    """

    def __init__(self, cfg: Config, grid: Grid, *, round_timeout: float | None = None,
                 connect_timeout: float = 120.0, query_timeout: float = 60.0, poll_interval: float = 1.0) -> None:
        self.cfg = cfg
        self.grid = grid
        self.round_timeout = round_timeout
        self.connect_timeout = connect_timeout
        self.query_timeout = query_timeout
        self.poll_interval = poll_interval
        self.config_text = cfg.to_toml()
        self.node_of: dict[int, int] = {}  # client id (= partition-id) -> node id
        self._ignored: set[int] = set()  # nodes that answered with no usable partition-id
        # partition-ids two connected nodes claimed at once -> those nodes: neither is sent that client's rounds
        self.contested: dict[int, set[int]] = {}
        self._connected = False

    # ------------------------------------------------------------ discovery
    def discover(self, wanted: Iterable[int], wait: float) -> None:
        """Map client ids to node ids: ask every connected node not known yet for its partition-id, polling
        up to ``wait`` seconds until every id in ``wanted`` has a node. Nodes gone offline are forgotten."""
        wanted = set(wanted)
        deadline = time.monotonic() + wait
        while True:
            online = set(self.grid.get_node_ids())
            for cid, node in list(self.node_of.items()):
                if node not in online:
                    log.info("client %d: node %d is no longer connected", cid, node)
                    del self.node_of[cid]
            known = set(self.node_of.values()) | self._ignored
            new = sorted(n for n in online if n not in known)
            if new:
                self._query_partitions(new)
            if wanted - self.contested.keys() <= self.node_of.keys() or time.monotonic() >= deadline:
                missing = sorted(wanted - self.node_of.keys() - self.contested.keys())
                if missing:
                    log.warning("no SuperNode connected for client(s) %s", missing)
                return
            time.sleep(self.poll_interval)

    def _query_partitions(self, nodes: list[int]) -> None:
        msgs = [Message(RecordDict({wire.PARTITION: ConfigRecord({})}), dst_node_id=n,
                        message_type=wire.PARTITION_QUERY, ttl=self.query_timeout)
                for n in nodes]
        clients = self.cfg.federation.clients
        for reply in self.grid.send_and_receive(msgs, timeout=self.query_timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("node %d did not tell its partition-id: %s", node, reply.error.reason)
                continue
            try:
                record = reply.content.config_records[wire.PARTITION]
                pid, num = int(record[wire.PARTITION_ID]), int(record[wire.NUM_PARTITIONS])
            except (KeyError, TypeError, ValueError) as err:
                log.warning("node %d: malformed partition reply (%s); ignored", node, err)
                self._ignored.add(node)
                continue
            if not 0 <= pid < clients or num not in (-1, clients):
                log.warning("node %d: partition-id=%d num-partitions=%d does not fit federation.clients = %d; "
                            "ignored", node, pid, num, clients)
                self._ignored.add(node)
            elif pid in self.contested or (pid in self.node_of and self.node_of[pid] != node):
                # Which one is the client cannot be told (no identity beyond the claim): neither takes the slot.
                nodes = self.contested.setdefault(pid, set()) | {node}
                if pid in self.node_of:
                    nodes.add(self.node_of.pop(pid))
                self.contested[pid] = nodes
                self._ignored |= nodes
                log.warning("partition-id=%d is claimed by nodes %s: neither is sent client %d's rounds for the rest "
                            "of the run (bind nodes to partitions with Flower's node authentication)",
                            pid, sorted(nodes), pid)
            else:
                self.node_of[pid] = node
                log.info("client %d <-> node %d", pid, node)

    # ------------------------------------------------------------ transport
    def __call__(self, downlinks: Downlinks, rnd: int) -> dict[int, Reply]:
        """Send each client its downlink through its SuperNode; their upload bytes, in the order of ``downlinks``
        (the aggregation sums in this order, as in process), or why a client has none."""
        clients = list(downlinks)
        self.discover(clients, 0.0 if self._connected else self.connect_timeout)
        self._connected = True
        ttl = self.round_timeout or DEFAULT_TTL
        sent: dict[int, int] = {}  # node id -> client id
        msgs = []
        for cid in clients:
            node = self.node_of.get(cid)
            if node is None:
                continue
            task = ConfigRecord({"round": rnd, "client": cid, "config": self.config_text})
            content = RecordDict({wire.DOWN: wire.bytes_record(downlinks[cid]), wire.TASK: task})
            msgs.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN,
                                group_id=str(rnd + 1), ttl=ttl))
            sent[node] = cid
        got: dict[int, Reply] = {}
        if msgs:
            replies = list(self.grid.send_and_receive(msgs, timeout=self.round_timeout))
            # A reply is matched to the message it answers: when a node is gone the SuperLink answers for it
            # (NODE_UNAVAILABLE, sender node 0), so the sender alone would not say which client it concerns.
            by_message = {m.metadata.message_id: sent[m.metadata.dst_node_id] for m in msgs if m.metadata.message_id}
            for reply in replies:
                cid = by_message.get(reply.metadata.reply_to_message_id, sent.get(reply.metadata.src_node_id))
                if cid is not None:
                    got[cid] = self._answer(reply, cid, rnd)
        out: dict[int, Reply] = {}
        for cid in clients:
            if cid in got:
                out[cid] = got[cid]
            elif cid in self.node_of:
                within = f" within {self.round_timeout:g} s" if self.round_timeout else ""
                out[cid] = ClientLost(f"no reply from node {self.node_of[cid]}{within}")
            elif cid in self.contested:
                out[cid] = ClientLost(f"partition-id={cid} is claimed by more than one node "
                                      f"({', '.join(map(str, sorted(self.contested[cid])))})")
            else:
                out[cid] = ClientLost(f"no SuperNode with partition-id={cid} is connected")
        return out

    def _answer(self, reply: Message, cid: int, rnd: int) -> Reply:
        answer = wire.reply_upload(reply, cid, rnd)
        if isinstance(answer, ClientLost):
            self.node_of.pop(cid, None)  # rediscovered when it comes back
        return answer


def server_settings(run_config: UserConfig) -> dict[str, Any]:
    """The ServerApp's settings from its run config (see the module docstring), checked."""
    missing = [k for k in ("config", "out") if not str(run_config.get(k, "")).strip()]
    if missing:
        raise ValueError(f"run config needs {' and '.join(missing)} (e.g. flwr run . <superlink> --run-config "
                         "\"config='/abs/experiment.toml' out='/abs/runs/name'\")")
    settings = {**DEFAULTS, **{k: run_config[k] for k in DEFAULTS if k in run_config}}
    out = {
        "config": Path(str(run_config["config"])).expanduser().resolve(),
        "out": Path(str(run_config["out"])).expanduser().resolve(),
        "resume": ("unverified" if settings["resume"] == "unverified"
                   else settings["resume"] in (True, "true", "True", 1)),
    }
    for key in ("round-timeout", "connect-timeout"):
        try:
            value = float(settings[key])
        except (TypeError, ValueError):
            raise ValueError(f"run config {key} must be a number of seconds, got {settings[key]!r}") from None
        if value < 0:
            raise ValueError(f"run config {key} must be >= 0, got {value}")
        out[key] = value
    return out


def on_simulation_engine(grid: Grid) -> bool:
    """Whether ``grid`` is the one of Flower's simulation engine (flwr 1.41: an ``InMemoryGrid``, which only the
    simulation runtime builds; a deployment's ServerApp gets an ``HttpGrid``)."""
    module = sys.modules.get("flwr.superlink.grid.inmemory_grid")  # not imported: not the simulation engine
    return module is not None and isinstance(grid, module.InMemoryGrid)


def check_simulation_size(grid: Grid, cfg: Config) -> None:
    """On the simulation engine every virtual SuperNode exists from the start, one per partition: their number
    must be ``federation.clients`` (ValueError saying how to set it otherwise). Elsewhere nothing is checked
    (SuperNodes connect over time; :meth:`FlowerTransport.discover` waits for them)."""
    if not on_simulation_engine(grid):
        return
    nodes, clients = len(list(grid.get_node_ids())), cfg.federation.clients
    if nodes != clients:
        raise ValueError(
            f"the simulation federation has {nodes} SuperNodes but the configuration has federation.clients = "
            f"{clients}: one SuperNode per client is needed (flwr run . <connection> --federation-config "
            f"'num-supernodes={clients}', or options.num-supernodes = {clients} in the connection of "
            "$FLWR_HOME/config.toml; docs/flower.md)")


def run_server(grid: Grid, run_config: UserConfig, **kwargs: Any) -> list[dict[str, Any]]:
    """Run the experiment of ``run_config`` over ``grid`` into its run directory; the metrics rows.
    ``kwargs`` go to :class:`FlowerTransport` (e.g. ``poll_interval``)."""
    s = server_settings(run_config)
    cfg = load_config(s["config"])
    check_simulation_size(grid, cfg)
    rounds = cfg.experiment.rounds
    log.info("dturbo %s: %s, %d clients, %d rounds -> %s", cfg.experiment.name, cfg.experiment.algorithm,
             cfg.federation.clients, rounds, s["out"])

    def on_round(row: dict[str, Any]) -> None:
        log.info("round %s/%d: accuracy %.4f, density %.4f, cum bits %.0f, participants %s (%s s)", row["round"],
                 rounds, float(row["accuracy"]), float(row["density"]), float(row["cum_bits"]),
                 row["participants"], row["seconds"])

    transport = FlowerTransport(cfg, grid, round_timeout=s["round-timeout"] or None,
                                connect_timeout=s["connect-timeout"], **kwargs)
    rows = Simulator(cfg, s["out"], resume=s["resume"], on_round=on_round, transport=transport).run()
    log.info("dturbo: run directory %s complete", s["out"])
    return rows


@app.main()
def main(grid: Grid, context: Context) -> None:
    """ServerApp entry point: run the experiment named in the run config."""
    run_server(grid, context.run_config)

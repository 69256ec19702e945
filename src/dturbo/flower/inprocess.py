"""A Flower Grid without network or Ray: each message goes straight to the ClientApp callable.

For tests and debugging of the Flower layer: the real ServerApp and ClientApp objects run in this process,
one :class:`~flwr.app.Context` per simulated SuperNode (its node config names ``partition-id`` and
``num-partitions``), and every message is deflated to Flower's wire objects and inflated back on both
ways, so what does not survive the wire fails here too.

It touches internal flwr APIs (pinned to 1.41): setting ``Metadata._message_id`` (the SuperLink's job),
:class:`flwr.supercore.task_identity.TaskIdentity` (which Flower's ServerApp runtime sets: a new Message takes
its run and source node from it) and :func:`flwr.supercore.inflatable.inflatable_utils.inflate_object_from_contents`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from ..algorithms.statistics import is_request
from ..attacks import ATTACKS, RoundView, hostile_clients
from ..config import Config
from . import wire
from .protocol import read_task

# (partition-id, message) -> "silent" (the node never answers it), "offline" (Flower's NODE_UNAVAILABLE error
# reply, as when the node disappears while the message waits) or None (it is delivered)
Interceptor = Callable[[int, Message], str | None]


def wire_copy(msg: Message) -> Message:
    """``msg`` after a trip through Flower's serialisation (its message id kept)."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}
    copy = inflate_object_from_contents(msg.object_id, contents)
    assert isinstance(copy, Message)
    copy.metadata.__dict__["_message_id"] = msg.metadata.message_id
    return copy


class InProcessGrid(Grid):
    """Simulated SuperNodes ``0..n-1`` (partition ids) running ``client_app`` in this process.

    Node ids are not the partition ids (as on a real SuperLink), so the server must discover the mapping.
    ``intercept`` can make a node ignore a message (it then never replies, as a node that hangs) or answer it
    as offline; a node in ``offline`` (partition ids) is not listed and a message to it gets Flower's
    NODE_UNAVAILABLE error reply; :meth:`reconnect` brings a node back under a new node id.
    """

    def __init__(self, client_app: ClientApp | Callable[[Message, Context], Message], num_nodes: int, *,
                 node_config: dict[str, Any] | None = None, intercept: Interceptor | None = None,
                 wire_roundtrip: bool = True, run_id: int = 1) -> None:
        self.client_app = client_app
        self.intercept = intercept
        self.wire_roundtrip = wire_roundtrip
        self._run = Run.create_empty(run_id)
        self.node_config = node_config or {}
        self.num_nodes = num_nodes
        # what flwr's ServerApp runtime sets before it calls the ServerApp
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
        self.partition_of: dict[int, int] = {}  # node id -> partition id
        self.contexts: dict[int, Context] = {}
        for pid in range(num_nodes):
            self._add_node(7_000_001 + 7919 * pid, pid)
        self.offline: set[int] = set()  # partition ids
        self.replies: dict[str, Message] = {}
        self.delivered: list[tuple[int, str]] = []  # (partition id, message type), for tests

    def _add_node(self, node_id: int, pid: int) -> None:
        self.partition_of[node_id] = pid
        cfg = {wire.PARTITION_ID: pid, wire.NUM_PARTITIONS: self.num_nodes, **self.node_config}
        self.contexts[node_id] = Context(run_id=self._run.run_id, node_id=node_id, node_config=cfg,
                                         state=RecordDict(), run_config={})

    def node_id(self, partition_id: int) -> int:
        """The current node id of a partition."""
        return next(n for n, p in self.partition_of.items() if p == partition_id)

    def reconnect(self, partition_id: int) -> int:
        """The node of ``partition_id`` comes back online under a new node id (as a restarted SuperNode)."""
        old = self.node_id(partition_id)
        del self.partition_of[old], self.contexts[old]
        self._add_node(old + 1_000_003, partition_id)
        self.offline.discard(partition_id)
        return self.node_id(partition_id)

    # ---------------------------------------------------------- Grid API
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [n for n, p in self.partition_of.items() if p not in self.offline]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = mid = uuid.uuid4().hex
            ids.append(mid)
            reply = self._deliver(msg)
            if reply is not None:
                reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                self.replies[mid] = wire_copy(reply) if self.wire_roundtrip else reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.replies.pop(mid) for mid in message_ids if mid in self.replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Every message is answered at once; one a node ignores has no reply (as after ``timeout``)."""
        return self.pull_messages(self.push_messages(messages))

    # ---------------------------------------------------------- delivery
    def _deliver(self, msg: Message) -> Message | None:
        node = msg.metadata.dst_node_id
        pid = self.partition_of.get(node)
        if pid is None or pid in self.offline:
            return self._unavailable(msg)
        action = None if self.intercept is None else self.intercept(pid, msg)
        if action == "offline":
            return self._unavailable(msg)
        if action == "silent":
            return None
        received = wire_copy(msg) if self.wire_roundtrip else msg
        self.delivered.append((pid, msg.metadata.message_type))
        try:
            return self.client_app(received, self.contexts[node])
        except Exception as ex:  # as Flower's ClientApp runtime: an error reply, the node goes on
            reason = f"{type(ex)}:<'{ex}'>"
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=received)

    @staticmethod
    def _unavailable(msg: Message) -> Message:
        """The SuperLink's answer for a node that is gone: an error reply whose sender is the SuperLink (node 0),
        not the node, as flwr's linkstate writes it."""
        reply = Message(Error(ErrorCode.NODE_UNAVAILABLE, f"node {msg.metadata.dst_node_id} is offline"), reply_to=msg)
        reply.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
        return reply


class HostileGrid(InProcessGrid):
    """An :class:`InProcessGrid` whose hostile nodes (``hostile``, partition ids; default: the attackers of
    ``cfg``'s ``[faults]``) answer as ``cfg``'s attack does, once the round's honest replies are in: what
    :class:`dturbo.faults.FaultyTransport` does to the simulator's clients, for a Strategy. ``server``: the
    Strategy's server algorithm when asked (the attacker reads and writes its messages; it exists once the
    Strategy starts)."""

    def __init__(self, client_app: ClientApp | Callable[[Message, Context], Message], num_nodes: int, cfg: Config,
                 server: Callable[[], Any], *, hostile: set[int] | None = None, **kwargs: Any) -> None:
        super().__init__(client_app, num_nodes, **kwargs)
        self.cfg, self.server = cfg, server
        self.hostile = set(hostile_clients(cfg)) if hostile is None else hostile
        self.attack = ATTACKS[cfg.faults.attack]()

    def rewrite(self, upload: bytes, downlink: bytes, view: Callable[[], RoundView]) -> bytes:
        """A hostile node's reply to ``downlink`` in place of ``upload``; ``view()``: what it knows of its round."""
        if is_request(downlink):
            return self.attack.statistics(upload)
        return self.attack.rewrite(upload, view())

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        replies = list(super().send_and_receive(messages, timeout=timeout))
        sent = {m.metadata.message_id: m for m in messages}
        train = []  # (client id, round, downlink, reply) of every upload
        for reply in replies:
            msg = sent.get(reply.metadata.reply_to_message_id)
            if msg is None or msg.metadata.message_type != wire.TRAIN or reply.has_error() \
                    or wire.UP not in reply.content.array_records:
                continue
            task = read_task(msg.content)
            train.append((task.client, task.round_idx, wire.record_bytes(msg.content, wire.DOWN), reply))
        honest = {c: wire.record_bytes(r.content, wire.UP) for c, _, _, r in train if c not in self.hostile}
        bad = [t for t in train if t[0] in self.hostile]
        for cid, rnd, down, reply in bad:
            def view(cid: int = cid, rnd: int = rnd, down: bytes = down) -> RoundView:
                return RoundView(self.server(), self.cfg, rnd, cid, down, honest, len(bad))

            reply.content[wire.UP] = wire.bytes_record(self.rewrite(wire.record_bytes(reply.content, wire.UP), down,
                                                                    view))
        return replies


def run_inprocess(config: str | Path, out: str | Path, *, resume: bool = False, grid: InProcessGrid | None = None,
                  server_app: ServerApp | None = None, run_config: dict[str, Any] | None = None) -> InProcessGrid:
    """Run the ServerApp over an :class:`InProcessGrid` (one node per client of the configuration, running
    the ClientApp) into the run directory ``out``; returns the grid."""
    from ..settings import load_config
    from .client_app import app as client_app
    from .server_app import app as default_server_app

    if grid is None:
        grid = InProcessGrid(client_app, load_config(config).federation.clients)
    rc = {"config": str(config), "out": str(out), "resume": resume, "connect-timeout": 0.0, **(run_config or {})}
    context = Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=rc)
    (server_app or default_server_app)(grid, context)
    return grid

"""What crosses Flower: the codec's bytes as a uint8 array, the task as a ConfigRecord.

A train instruction (message type ``train``) carries

* ``down``: an ArrayRecord with one Array ``bytes``, the downlink message as a 1-D uint8 array;
* ``task``: a ConfigRecord with ``round`` (0-based), ``client`` (the client id = the SuperNode's
  ``partition-id``) and ``config`` (the whole experiment configuration as TOML text, so that server and
  client use exactly the same configuration).

Its reply carries ``up`` (the upload bytes, same layout) and ``task`` (``client``, ``round``), or, when the
client algorithm reports a :class:`~dturbo.algorithms.base.ClientError` (e.g. its training diverged),
``failure``: a ConfigRecord with ``client`` and ``reason``. Any other exception in the ClientApp becomes a
Flower error reply (``Message.error``), made by Flower's runtime.

A discovery query (message type ``query.partition``) asks a SuperNode for its ``partition-id`` (and
``num-partitions`` when its node config names it); its reply carries them in the ConfigRecord
``partition``.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import ErrorCode

from ..algorithms.base import ClientError
from ..transport import ClientLost, Reply

TRAIN = "train"
PARTITION_QUERY = "query.partition"
PARTITION_ACTION = "partition"

DOWN, UP, TASK, FAILURE, PARTITION = "down", "up", "task", "failure", "partition"
BYTES = "bytes"

PARTITION_ID, NUM_PARTITIONS, DATA_PATH = "partition-id", "num-partitions", "data-path"

# Flower error replies that mean "the node never answered" (-> ClientLost); every other code means the
# ClientApp ran and failed (-> ClientError).
LOST_CODES = frozenset({ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE})


class WireError(ValueError):
    """A Flower message does not have the layout of :mod:`dturbo.flower.wire`."""


def bytes_record(data: bytes) -> ArrayRecord:
    """``data`` as an ArrayRecord holding one 1-D uint8 Array named ``bytes``."""
    return ArrayRecord({BYTES: Array(np.frombuffer(data, dtype=np.uint8))})


def record_bytes(content: RecordDict, name: str, max_bytes: int | None = None) -> bytes:
    """The bytes that :func:`bytes_record` packed into ``content[name]``; of more than ``max_bytes`` (an upload over
    the server's size bound: refused, and booked at the bound) only the first ``max_bytes + 1``, read from the Array
    without a copy of the whole."""
    if name not in content.array_records:
        raise WireError(f"message has no ArrayRecord {name!r} (has {sorted(content.keys())})")
    record = content.array_records[name]
    if BYTES not in record:
        raise WireError(f"ArrayRecord {name!r} has no Array {BYTES!r}")
    array = record[BYTES]
    if (max_bytes is not None and array.dtype == "uint8" and len(array.shape) == 1 and array.shape[0] > max_bytes
            and array.data[:6] == b"\x93NUMPY"):
        # .npy: magic, version, header length (2 bytes in version 1, else 4), header, then the values
        start = 10 + int.from_bytes(array.data[8:10], "little") if array.data[6] == 1 else (
            12 + int.from_bytes(array.data[8:12], "little"))
        return bytes(memoryview(array.data)[start:start + max_bytes + 1])
    arr = array.numpy()
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise WireError(f"{name}.{BYTES} must be a 1-D uint8 array, got {arr.dtype} {arr.shape}")
    return arr.tobytes()


def task_record(content: RecordDict) -> ConfigRecord:
    """The ``task`` ConfigRecord of a train message or reply."""
    if TASK not in content.config_records:
        raise WireError(f"message has no ConfigRecord {TASK!r}")
    return content.config_records[TASK]


def partition_of(context: Context) -> tuple[int, int | None]:
    """(partition-id, num-partitions or None) from a SuperNode's node config."""
    cfg = context.node_config
    if PARTITION_ID not in cfg:
        raise WireError(f"this SuperNode's node config has no {PARTITION_ID!r}; start it with "
                        f"--node-config \"{PARTITION_ID}=<client id> {NUM_PARTITIONS}=<clients>\"")
    pid = cfg[PARTITION_ID]
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 0:
        raise WireError(f"node config {PARTITION_ID} must be a non-negative integer, got {pid!r}")
    num = cfg.get(NUM_PARTITIONS)
    if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 1):
        raise WireError(f"node config {NUM_PARTITIONS} must be a positive integer, got {num!r}")
    return pid, num


def reply_upload(reply: Message, cid: int, rnd: int, max_bytes: int | None = None) -> Reply:
    """A train reply of client ``cid`` in round ``rnd`` (0-based) as a runner's reply: its upload bytes (over
    ``max_bytes``, the first ``max_bytes + 1``: :func:`record_bytes`), or why there are none
    (:class:`~dturbo.transport.ClientLost` when the node never answered, else a
    :class:`~dturbo.algorithms.base.ClientError` with the reason)."""
    if reply.has_error():
        err = reply.error
        if err.code in LOST_CODES:
            return ClientLost(f"Flower error {err.code}: {err.reason}")
        return ClientError(f"ClientApp failed (Flower error {err.code}): {err.reason}")
    content = reply.content
    if FAILURE in content.config_records:
        return ClientError(str(content.config_records[FAILURE].get("reason", "failed")))
    try:
        task = task_record(content)
        if int(task["client"]) != cid or int(task["round"]) != rnd:
            raise WireError(f"reply is for client {task['client']}, round {task['round']}")
        return record_bytes(content, UP, max_bytes)
    except (WireError, KeyError, TypeError, ValueError) as err:
        return ClientError(f"malformed reply: {err}")

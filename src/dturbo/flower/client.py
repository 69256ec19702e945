"""Client helpers for a Flower user's own ClientApp: D-Turbo-VBI (or STC, FedDST) training on the user's model.

The user keeps writing their ClientApp; each handler hands the received Message, the node's Context, their model
and their data to a helper and returns what it returns::

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = dturbo.bayesianize(Net())
        trainloader, _ = load_data(context.node_config["partition-id"], context.node_config["num-partitions"])
        return dturbo.flower.fit(msg, context, model, trainloader)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        ...
        return dturbo.flower.evaluate(msg, context, model, valloader)

    @app.query("dturbo")
    def count(msg: Message, context: Context) -> Message:
        ...
        return dturbo.flower.count_samples(msg, context, trainloader)

* :func:`fit` builds, once per process, the client half of the strategy's algorithm on a copy of ``model`` from
  the settings in the message (:mod:`dturbo.flower.protocol`), runs ``client.fit(downlink, data, client id)``
  (the code ``dturbo run`` runs) and replies with the upload bytes. Afterwards ``model`` holds the locally trained
  weights.
* :func:`evaluate` decodes the global model of an evaluate message into ``model`` and replies with its loss and
  accuracy on the data.
* :func:`count_samples` answers the strategy's question before the first round (how many training samples, which
  ``partition-id``), needed when the strategy is not given ``total_samples``.

``model``: the same architecture as the strategy's, made Bayesian with :func:`dturbo.bayesianize` (a model without
Bayesian layers is made so here, in place, with the configuration's ``sigma_mode`` and ``sigma_init_ratio``). Its
weights do not matter: the downlink carries the global model, and the prior's layer scales come from the server.

``data``: a ``torch.utils.data.DataLoader`` (or any iterable of ``(x, y)`` batches, or of dicts with an image key
``img`` / ``image`` / ``x`` and a label key ``label`` / ``labels`` / ``y``), a ``(x, y)`` pair of tensors or arrays,
or a :class:`~dturbo.algorithms.base.ClientData`. A loader is read once, in order, into tensors: dturbo's local
training draws its own minibatches (``[train] batch_size``, seeded by the run's seed, the round and the client id),
so the loader's batch size and shuffling do not change the training, and random augmentations are drawn once.

Client state: STC (the model copy and the error-feedback residual), FedDST (the masks it holds) and D-Turbo-VBI
with ``transmission.positions = "delta"`` (the supports it holds) keep private state between rounds; it is saved
in the node's ``Context.state`` after each round and imported into a client object that did not make it (a fresh
ClientApp process), exactly as the repository's own ClientApp does (:mod:`dturbo.flower.client_app`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from ..algorithms.base import ClientAlgorithm, ClientData, ClientError, MessageError
from ..algorithms.registry import model_options
from ..algorithms.statistics import answer, is_request
from ..codec import CodecError
from ..config import Config
from ..nn.bayes import bayesian_layers
from ..nn.convert import bayesianize
from ..nn.models import record_input_shape
from ..protocol import NO_CLIENT
from . import protocol, wire
from .client_app import ClientRuntime, restore_state, save_state

log = logging.getLogger("flwr")

DataSource = Any  # a DataLoader / iterable of batches, an (x, y) pair, or a ClientData (module docstring)

_IMAGE_KEYS, _LABEL_KEYS = ("img", "image", "x", "pixel_values"), ("label", "labels", "y")


@dataclass
class Runtime:
    """The client half of one configuration on one architecture, built once per process."""

    cfg: Config
    client: ClientAlgorithm
    synced: dict[int, str] = dataclasses.field(default_factory=dict)  # as ClientRuntime.synced


_CACHE: dict[tuple[str, ...], Runtime] = {}


# ------------------------------------------------------------------------------------------------ data
def client_data(data: DataSource) -> ClientData:
    """``data`` as the tensors dturbo's local training reads (module docstring: what it may be)."""
    if isinstance(data, ClientData):
        return data
    if isinstance(data, tuple | list) and len(data) == 2 and not _is_batch_list(data):
        return _as_client_data(data[0], data[1])
    if isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        data = torch.utils.data.DataLoader(data, batch_size=1024, shuffle=False)
    if not isinstance(data, Iterable):
        raise TypeError(f"data must be a DataLoader, an (x, y) pair or a dturbo ClientData, not {type(data).__name__}")
    xs, ys = [], []
    for batch in data:
        x, y = _batch_xy(batch)
        xs.append(torch.as_tensor(x))
        ys.append(torch.as_tensor(y))
    if not xs:
        raise ValueError("the data loader yields no batch: this node has no training data")
    return _as_client_data(torch.cat(xs), torch.cat(ys))


def _is_batch_list(data: tuple | list) -> bool:
    """A list of two batches (each an (x, y) pair or a dict) rather than one (x, y) pair."""
    return all(isinstance(b, tuple | list | dict) for b in data)


def _batch_xy(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, dict):
        x = next((batch[k] for k in _IMAGE_KEYS if k in batch), None)
        y = next((batch[k] for k in _LABEL_KEYS if k in batch), None)
        if x is None or y is None:
            raise TypeError(f"a batch dict needs an input key ({', '.join(_IMAGE_KEYS)}) and a label key "
                            f"({', '.join(_LABEL_KEYS)}); got {sorted(batch)}")
        return x, y
    if isinstance(batch, tuple | list) and len(batch) >= 2:
        return batch[0], batch[1]
    raise TypeError(f"a batch must be an (inputs, labels) pair or a dict, not {type(batch).__name__}")


def _as_client_data(x: Any, y: Any) -> ClientData:
    xt = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).float()
    yt = torch.as_tensor(np.asarray(y) if not isinstance(y, torch.Tensor) else y).long().reshape(-1)
    if xt.shape[0] != yt.shape[0]:
        raise ValueError(f"data has {xt.shape[0]} inputs but {yt.shape[0]} labels")
    return ClientData(xt, yt)


# --------------------------------------------------------------------------------------------- the client
def bayesian_model(model: nn.Module, cfg: Config) -> nn.Module:
    """``model`` with Bayesian layers: made so in place when it has none, with the method's model options
    (:func:`dturbo.algorithms.registry.model_options`: D-Turbo-VBI's sigma settings); ValueError when its layers'
    sigma is not kept as those options say."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    options = model_options(cfg)
    if not bayesian_layers(model):
        model = bayesianize(model, **options)
    check_sigma_mode(model, options.get("sigma_mode", "layer"))
    return model


def check_sigma_mode(model: nn.Module, sigma_mode: str) -> None:
    """ValueError when the model's Bayesian layers keep sigma otherwise than ``sigma_mode`` (the method's model
    option, ``[dturbo] sigma_mode``) says."""
    want = "weight" if sigma_mode == "weight" else "layer"
    wrong = [name for name, layer in bayesian_layers(model) if layer.sigma_mode != want]
    if wrong:
        raise ValueError(f"layers {', '.join(wrong)} keep sigma per {'layer' if want == 'weight' else 'weight'}, "
                         f"but dturbo.sigma_mode = {sigma_mode!r}: bayesianize the model with "
                         f"sigma_mode={sigma_mode!r}")


def _architecture(model: nn.Module) -> str:
    """A digest of the model's state names and shapes: one client object per architecture."""
    text = ";".join(f"{k}:{tuple(v.shape)}" for k, v in model.state_dict().items())
    return hashlib.sha256(f"{type(model).__qualname__}|{text}".encode()).hexdigest()


def runtime(task: protocol.Task, model: nn.Module) -> Runtime:
    """The client half of the task's algorithm on ``model``'s architecture (built once per process and
    configuration; a new one replaces the previous one)."""
    cfg = protocol.parse_settings(task.settings)
    model = bayesian_model(model, cfg)
    protocol.check_same_model(task.layers, protocol.model_grids(model))
    key = (task.algorithm, hashlib.sha256(task.settings.encode()).hexdigest(),
           "|".join(la.text() for la in task.layers), _architecture(model))
    if key in _CACHE:
        return _CACHE[key]
    from ..algorithms.registry import ALGORITHMS

    if cfg.experiment.threads:  # as the runner: reductions depend on the thread count
        torch.set_num_threads(cfg.experiment.threads)
    snapshot = copy.deepcopy(model).cpu().float()

    def factory() -> nn.Module:
        return copy.deepcopy(snapshot)

    client = ALGORITHMS[task.algorithm].client(cfg, factory)
    client.use_server_priors([la.scale for la in task.layers])
    _CACHE.clear()
    _CACHE[key] = made = Runtime(cfg, client)
    return made


def _state_runtime(rt: Runtime) -> ClientRuntime:
    """The view of ``rt`` that client_app's state functions read (``client``, ``synced``)."""
    return cast(ClientRuntime, rt)


# ------------------------------------------------------------------------------------------------- replies
def fit(msg: Message, context: Context, model: nn.Module, data: DataSource) -> Message:
    """Train on ``data`` as the strategy's train message says and return the reply (module docstring). A failure
    of the client algorithm itself (e.g. diverged training, a lost STC model copy) is a ``failure`` reply with the
    reason, which the strategy counts as ``clients_failed``; anything else raises (Flower's error reply)."""
    task = protocol.read_task(msg.content)
    rt = runtime(task, model)
    local = client_data(data)
    record_input_shape(rt.client.model, local.x.shape[1:])  # what budget = "flops" and the cut read
    down = wire.record_bytes(msg.content, wire.DOWN)
    cid, rnd = task.client, task.round_idx
    calibration = is_request(down)
    try:
        restore_state(_state_runtime(rt), context, cid, rnd)
        up = answer(rt.client, down, local, cid)  # a training upload, or BatchNorm statistics
    except ClientError as err:
        log.warning("dturbo client %d, round %d: %s", cid, rnd + 1, err)
        failure = ConfigRecord({"client": cid, "round": rnd, "reason": str(err)})
        return Message(RecordDict({wire.FAILURE: failure}), reply_to=msg)
    save_state(_state_runtime(rt), context, cid, rnd)
    if not calibration:  # the user's model holds the locally trained weights
        bayesian_model(model, rt.cfg).load_state_dict(rt.client.model.state_dict())
    reply = RecordDict({
        wire.UP: wire.bytes_record(up),
        protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: len(local)}),
        wire.TASK: ConfigRecord({"client": cid, "round": rnd}),
    })
    return Message(reply, reply_to=msg)


def evaluate(msg: Message, context: Context, model: nn.Module, data: DataSource, batch_size: int = 1000) -> Message:
    """Load the global model of the strategy's evaluate message into ``model`` and reply with ``eval_loss`` (mean
    cross-entropy), ``eval_acc`` and ``num-examples`` on ``data``."""
    from ..device import resolve_device
    from ..sim import evaluate as evaluate_model

    task = protocol.read_task(msg.content)
    rt = runtime(task, model)
    model = bayesian_model(model, rt.cfg)
    load_global(rt, wire.record_bytes(msg.content, wire.DOWN), model)
    local = client_data(data)
    acc, loss = evaluate_model(model, local.x, local.y, batch_size=batch_size,
                               device=resolve_device(rt.cfg.experiment.device))
    model.cpu()
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, protocol.NUM_EXAMPLES: len(local)})
    return Message(RecordDict({protocol.METRICS: metrics}), reply_to=msg)


def count_samples(msg: Message, context: Context, data: DataSource) -> Message:
    """Reply to the strategy's query (:data:`dturbo.flower.protocol.QUERY`): this node's training sample count and
    its node config's ``partition-id`` (-1 when it has none)."""
    pid = context.node_config.get(wire.PARTITION_ID, -1)
    pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid >= 0 else -1
    content = RecordDict({protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: len(client_data(data))}),
                          wire.TASK: ConfigRecord({wire.PARTITION_ID: pid})})
    return Message(content, reply_to=msg)


# ------------------------------------------------------------------------------------ the global model
def load_global(rt: Runtime, down: bytes, model: nn.Module) -> None:
    """Put the global model of a downlink that needs no client state (the strategy's evaluation downlink,
    :meth:`dturbo.protocol.ServerAlgorithm.evaluation_downlink`) into ``model``, as the client algorithm loads it
    (:meth:`dturbo.protocol.ClientAlgorithm.receive`, for a node that holds nothing). MessageError when the bytes do
    not decode for this model."""
    try:
        loaded = rt.client.receive(down, NO_CLIENT)
    except (MessageError, CodecError, ClientError, ValueError) as err:
        raise MessageError(f"the evaluate message's global model does not decode: {err}") from None
    model.load_state_dict(loaded.state_dict())
    model.eval()

"""dturboapp: a Flower ClientApp that trains the app's model with D-Turbo-VBI.

The handlers are a Flower user's own; :func:`dturbo.flower.fit`, :func:`dturbo.flower.evaluate` and
:func:`dturbo.flower.count_samples` do the dturbo part. ``message_size_mod`` logs each Message's size as Flower
counts it, the same count the strategy records as ``flower_down_bytes`` / ``flower_up_bytes``.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import message_size_mod
from torch.utils.data import DataLoader

import dturbo
import dturbo.flower
from dturboapp.task import Net, load_data

app = ClientApp(mods=[message_size_mod])


def node_data(context: Context) -> tuple[DataLoader, DataLoader]:
    rc, nc = context.run_config, context.node_config
    return load_data(int(nc["partition-id"]), int(nc["num-partitions"]), str(rc["data-path"]),
                     int(rc["batch-size"]), int(rc["samples-per-node"]))


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model on the local data with D-Turbo-VBI; reply with the coded upload."""
    model = dturbo.bayesianize(Net())
    trainloader, _ = node_data(context)
    return dturbo.flower.fit(msg, context, model, trainloader)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the global model on the local validation data."""
    model = dturbo.bayesianize(Net())
    _, valloader = node_data(context)
    return dturbo.flower.evaluate(msg, context, model, valloader)


@app.query("dturbo")
def count(msg: Message, context: Context) -> Message:
    """Tell the strategy how many training samples this node holds (its n_t; their sum is the n of E6)."""
    trainloader, _ = node_data(context)
    return dturbo.flower.count_samples(msg, context, trainloader)

"""dturbo.flower's Strategy and client helpers in a Flower user's own app, on a network dturbo never saw.

One run goes through Flower's own simulation entry point (``flwr.simulation.run_simulation``, Ray workers); the
others drive the strategy over :class:`dturbo.flower.inprocess.InProcessGrid` (every message still crosses Flower's
serialisation), where they also equal the runner (``dturbo.sim.Simulator``, what ``dturbo run`` runs) for the same
configuration, model, data split and seed: the strategy's server side and the helpers' client side are the runner's.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("flwr", reason="flwr is not installed (pip install -e '.[flower]')")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402

import dturbo  # noqa: E402
import dturbo.flower as dflower  # noqa: E402
from dturbo.algorithms.base import ClientData  # noqa: E402
from dturbo.algorithms.dturbo.layers import layer_infos  # noqa: E402
from dturbo.algorithms.dturbo.units import DeadUnits  # noqa: E402
from dturbo.checkpoint import CheckpointError  # noqa: E402
from dturbo.config import Config, ConfigError  # noqa: E402
from dturbo.data import dataset_from_arrays  # noqa: E402
from dturbo.federation import Federation, build_federation  # noqa: E402
from dturbo.flower import client as client_module  # noqa: E402
from dturbo.flower import protocol, wire  # noqa: E402
from dturbo.flower.inprocess import InProcessGrid  # noqa: E402
from dturbo.nn.bayes import bayesian_layers  # noqa: E402
from dturbo.nn.convert import user_model_factory  # noqa: E402
from dturbo.settings import load_config  # noqa: E402
from dturbo.sim import Simulator, evaluate  # noqa: E402

CLIENTS = 3
# Flower's .npy header of a 1-D uint8 Array (flwr.app.Array.data), which ArrayRecord.count_bytes counts with the payload
NPY_HEADER = 128


class TinyNet(nn.Module):
    """A small network of the test's own: a hidden block and a head, a ReLU between."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 24), nn.ReLU())
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class BnNet(nn.Module):
    """TinyNet with BatchNorm after its hidden layer: the strategy calibrates its statistics as the runner does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.ReLU())
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class OtherNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def toy_arrays(n: int = 600) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 12)).astype(np.float32)
    y = (x[:, :3].sum(1) > 0).astype(np.int64) + 2 * (x[:, 3] > 0)
    return x, y


def partition(pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Node ``pid``'s share of the toy data (as a user's load_data would give it)."""
    x, y = toy_arrays()
    idx = np.array_split(np.arange(len(y)), CLIENTS)[pid]
    return torch.from_numpy(x[idx]), torch.from_numpy(y[idx])


FAST = {"train.local_steps": 4, "train.batch_size": 32, "train.lr": 0.01, "experiment.threads": 1}
SPARSITY = {"target_density": 0.5, "warmup_rounds": 0, "ramp_rounds": 1}


def user_client_app(data_of=partition, with_query: bool = True, net: type[nn.Module] = TinyNet) -> ClientApp:
    """A user's ClientApp: their model, their data, the helpers."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return dflower.fit(msg, context, dturbo.bayesianize(net()), data_of(context.node_config["partition-id"]))

    @app.evaluate()
    def evaluate_(msg: Message, context: Context) -> Message:
        return dflower.evaluate(msg, context, dturbo.bayesianize(net()),
                                data_of(context.node_config["partition-id"]))

    if with_query:
        @app.query("dturbo")
        def count(msg: Message, context: Context) -> Message:
            return dflower.count_samples(msg, context, data_of(context.node_config["partition-id"]))

    return app


def density_of(state_dict: dict[str, torch.Tensor]) -> float:
    """Nonzero weights of the Bayesian layers of a global model's state_dict (weight_mu is 0 off the support)."""
    w = [v for k, v in state_dict.items() if k.endswith("weight_mu")]
    return sum(int(torch.count_nonzero(t)) for t in w) / sum(t.numel() for t in w)


# ------------------------------------------------------------------------- Flower's simulation entry point
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")  # Ray's notice about its accelerator variables
def test_run_simulation_two_rounds_three_clients() -> None:
    """The strategy in a user's ServerApp, the helpers in their ClientApp, on Flower's simulation engine."""
    pytest.importorskip("ray", reason="Flower's simulation engine needs ray (pip install -e '.[simulation]')")
    from flwr.simulation import run_simulation

    out: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid, context: Context) -> None:
        model = dturbo.bayesianize(TinyNet())
        x, y = toy_arrays()

        def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            net = dturbo.bayesianize(TinyNet())
            net.load_state_dict(arrays.to_torch_state_dict())
            acc, loss = evaluate(net, torch.from_numpy(x[:200]), torch.from_numpy(y[:200]))
            return MetricRecord({"accuracy": acc, "loss": loss})

        strategy = dflower.DTurboVBI(model, overrides=FAST, sparsity=SPARSITY, fraction_evaluate=1.0)
        out["result"] = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=2,
                                       evaluate_fn=central)
        out["strategy"] = strategy

    t0 = time.perf_counter()
    run_simulation(server_app, user_client_app(), num_supernodes=CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}})
    seconds = time.perf_counter() - t0
    assert "result" in out, "the ServerApp did not finish"
    result, strategy = out["result"], out["strategy"]
    assert set(result.train_metrics_clientapp) == {1, 2}
    last = result.train_metrics_clientapp[2]
    assert last["clients_ok"] == CLIENTS and last["clients_failed"] == 0 and last["clients_dropped"] == 0
    # the final arrays are the global model: sparse, at the density the server reports
    sd = result.arrays.to_torch_state_dict()
    assert density_of(sd) == pytest.approx(last["density"]) and density_of(sd) < 0.6
    net = dturbo.bayesianize(TinyNet())
    net.load_state_dict(sd)
    assert result.evaluate_metrics_serverapp[2]["accuracy"] > 0.3
    assert {"eval_acc", "eval_loss", "eval_down_bits"} <= set(result.evaluate_metrics_clientapp[2])
    # bits: 8 x the bytes, and Flower's sizes are those bytes plus its framing
    for rnd, m in result.train_metrics_clientapp.items():
        assert m["up_bits"] % 8 == 0 and m["down_bits"] % 8 == 0
        assert m["up_bits"] == m["up_headers_bits"] + m["up_positions_bits"] + m["up_values_bits"]
        reply_framing = NPY_HEADER + len(wire.BYTES) + reply_records_bytes()
        assert m["flower_up_bytes"] - m["up_bits"] // 8 == CLIENTS * reply_framing, rnd
        assert m["flower_down_bytes"] - m["down_bits"] // 8 == sum(
            train_framing(strategy, rnd, cid) for cid in range(CLIENTS)), rnd
    assert result.train_metrics_clientapp[2]["cum_bits"] == sum(
        m["up_bits"] + m["down_bits"] for m in result.train_metrics_clientapp.values())
    print(f"run_simulation, 3 clients, 2 rounds: {seconds:.1f} s")


def reply_records_bytes() -> int:
    """Flower's count of a train reply's records besides the upload: metrics (num-examples) and task."""
    return (MetricRecord({protocol.NUM_EXAMPLES: 1}).count_bytes()
            + ConfigRecord({"client": 0, "round": 0}).count_bytes())


def train_framing(strategy: dflower.DturboStrategy, server_round: int, cid: int) -> int:
    """Flower's bytes of a train message beyond its coded downlink: the .npy header, the Array's name, the task
    (with the settings text and the model's layers) and the config record with ``server-round``."""
    session = strategy.session
    task = protocol.Task(strategy.algorithm, server_round - 1, cid, session.settings, session.layers)
    return (NPY_HEADER + len(wire.BYTES) + task.record().count_bytes()
            + ConfigRecord({"server-round": server_round}).count_bytes())


# ------------------------------------------------------------------------------- equal to the runner
def runner_config(algorithm: str, rounds: int = 3) -> dict:
    return {
        "experiment": {"seed": 2, "rounds": rounds, "threads": 1, "algorithm": algorithm},
        "data": {"name": "arrays"},
        "federation": {"clients": CLIENTS, "partition": "iid"},
        "model": {"name": "custom"},
        "train": {"local_steps": 4, "batch_size": 32, "lr": 0.01},
        "dturbo": {"sparsity": {"target_density": 0.5, "warmup_rounds": 0, "ramp_rounds": 2}},
        "stc": {"p_up": 0.1, "p_down": 0.1},
        "feddst": {"density": 0.5, "readjust_every": 1, "readjust_ratio": 0.2},
    }


def federation(cfg_dict: dict) -> Federation:
    x, y = toy_arrays()
    return build_federation(load_config(cfg_dict), dataset_from_arrays(x, y, x[:200], y[:200]))


def run_runner(cfg: Config, fed: Federation, net: type[nn.Module], out: Path) -> tuple[Simulator, list[dict]]:
    """``cfg`` with ``net`` on ``fed`` through the runner (``dturbo run``'s Simulator): it and its metrics rows."""
    d = cfg.dturbo
    factory = user_model_factory(net, sigma_mode=d.sigma_mode, sigma_init_ratio=d.sigma_init_ratio,
                                 seed=cfg.experiment.seed, input_shape=(12,))
    sim = Simulator(cfg, out, federation=fed, model=lambda _ds: factory)
    return sim, sim.run()


# D-Turbo-VBI with whole hidden units and dead_units = "cut" (a unit left without weights takes its head columns)
CUT = {"dead_units": "cut", "prior": {"dense": {"tie_rows": True}},
       "sparsity": {"target_density": 0.3, "warmup_rounds": 0, "ramp_rounds": 2}}


@pytest.mark.parametrize(("algorithm", "net"), [("dturbo", TinyNet), ("stc", TinyNet), ("feddst", TinyNet),
                                                ("fedavg", TinyNet), ("dturbo", BnNet), ("dturbo_cut", TinyNet)])
def test_strategy_equals_the_runner(tmp_path: Path, algorithm: str, net: type[nn.Module]) -> None:
    """Same configuration, model, split and seed: the same bits every round and the same final model as
    ``Simulator`` (``dturbo run``). STC and FedDST keep client state: here every message meets a fresh client object
    (as a deployment's fresh ClientApp process), so the state travels in Context.state. With BatchNorm both
    calibrate its statistics (train messages carrying a ``calibrate`` message, answered by the same ``fit``)."""
    cfg_dict = runner_config(algorithm.removesuffix("_cut"))
    if algorithm.endswith("_cut"):
        cfg_dict["dturbo"] = CUT
    algorithm = algorithm.removesuffix("_cut")
    cfg = load_config(cfg_dict)
    fed = federation(cfg_dict)
    sim, rows = run_runner(cfg, fed, net, tmp_path / "runner")

    sent: list[tuple[str, int]] = []  # (message kind, bytes of the coded payload)

    def fresh_process(pid: int, msg: Message) -> None:
        client_module._CACHE.clear()
        if msg.metadata.message_type == "train":
            sent.append(("down", len(wire.record_bytes(msg.content, wire.DOWN))))

    app = user_client_app(lambda pid: fed.clients[pid], with_query=True, net=net)

    def recording_app(msg: Message, context: Context) -> Message:
        reply = app(msg, context)
        if msg.metadata.message_type == "train" and wire.UP in reply.content.array_records:
            sent.append(("up", len(wire.record_bytes(reply.content, wire.UP))))
        return reply

    grid = InProcessGrid(recording_app, CLIENTS, intercept=fresh_process)
    strategy = dflower.DturboStrategy(net, algorithm=algorithm, config=cfg_dict, fraction_evaluate=0.0,
                                      input_shape=(12,))
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=cfg.experiment.rounds)

    assert strategy.session.total_samples == fed.total_samples
    for row in rows:
        m = result.train_metrics_clientapp[row["round"]]
        for key in ("density", "up_bits", "down_bits", "cum_bits", "up_headers_bits", "up_positions_bits",
                    "up_values_bits", "down_headers_bits", "down_positions_bits", "down_values_bits",
                    *(["calibration_bits"] if net is BnNet else [])):
            assert m[key] == pytest.approx(float(row[key]), rel=0, abs=0), (row["round"], key)
    final = strategy.global_model().state_dict()
    for key, value in sim.final_model.state_dict().items():
        assert torch.equal(final[key], value), key
    acc, _ = evaluate(strategy.global_model(), fed.x_test, fed.y_test)
    assert acc == float(rows[-1]["accuracy"])
    # the ledger is 8 x the bytes that crossed, each direction
    assert sum(m["down_bits"] for m in result.train_metrics_clientapp.values()) == 8 * sum(
        b for kind, b in sent if kind == "down")
    assert sum(m["up_bits"] for m in result.train_metrics_clientapp.values()) == 8 * sum(
        b for kind, b in sent if kind == "up")


class _Cut(Exception):
    pass


@pytest.mark.parametrize(("algorithm", "net"), [("dturbo", TinyNet), ("stc", TinyNet), ("dturbo", BnNet)])
def test_a_strategy_started_again_from_its_checkpoint_equals_an_uninterrupted_run(
        tmp_path: Path, algorithm: str, net: type[nn.Module]) -> None:
    """checkpoint=: a run cut after round 2 and started again with the same folder, settings and nodes continues
    with round 3 and ends as a run never cut: the same bits and metrics every round, the same final model."""
    cfg_dict = runner_config(algorithm, rounds=4)
    fed = federation(cfg_dict)

    def grid() -> InProcessGrid:
        return InProcessGrid(user_client_app(lambda pid: fed.clients[pid], net=net), CLIENTS,
                             intercept=lambda pid, msg: client_module._CACHE.clear())

    def strategy(folder: Path) -> dflower.DturboStrategy:
        return dflower.DturboStrategy(net, algorithm=algorithm, config=cfg_dict, fraction_evaluate=0.0,
                                      checkpoint=folder)

    whole = strategy(tmp_path / "whole")
    full = whole.start(grid=grid(), initial_arrays=ArrayRecord(), num_rounds=4)

    def cut(server_round: int, arrays: ArrayRecord) -> None:
        if server_round == 2:
            raise _Cut

    nodes = grid()  # the nodes live on: their client state (STC's residuals, D-Turbo-VBI's supports) with them
    with pytest.raises(_Cut):
        strategy(tmp_path / "cut").start(grid=nodes, initial_arrays=ArrayRecord(), num_rounds=4, evaluate_fn=cut)
    seen: list[int] = []
    again = strategy(tmp_path / "cut")
    rest = again.start(grid=nodes, initial_arrays=ArrayRecord(), num_rounds=4,
                       evaluate_fn=lambda r, arrays: seen.append(r))
    assert sorted(rest.train_metrics_clientapp) == [3, 4] and seen == [2, 3, 4]
    for rnd in (3, 4):
        a, b = full.train_metrics_clientapp[rnd], rest.train_metrics_clientapp[rnd]
        for key in ("density", "up_bits", "down_bits", "cum_bits", "clients_ok",
                    *(["calibration_bits"] if net is BnNet else [])):
            assert a[key] == b[key], (rnd, key)
    final, expected = again.global_model().state_dict(), whole.global_model().state_dict()
    assert all(torch.equal(final[k], v) for k, v in expected.items())
    assert rest.arrays.to_torch_state_dict().keys() == final.keys()


def test_a_checkpoint_of_other_settings_is_refused_and_kept(tmp_path: Path) -> None:
    cfg_dict = runner_config("dturbo", rounds=2)
    fed = federation(cfg_dict)
    nodes = InProcessGrid(user_client_app(lambda pid: fed.clients[pid]), CLIENTS)
    dflower.DturboStrategy(TinyNet, config=cfg_dict, fraction_evaluate=0.0, checkpoint=tmp_path).start(
        grid=nodes, initial_arrays=ArrayRecord(), num_rounds=1)
    saved = (tmp_path / "state.safetensors").read_bytes()
    other = dflower.DturboStrategy(TinyNet, config=cfg_dict, fraction_evaluate=0.0, checkpoint=tmp_path,
                                   overrides={"train.lr": 0.02})
    with pytest.raises(CheckpointError, match="another configuration"):
        other.start(grid=nodes, initial_arrays=ArrayRecord(), num_rounds=2)
    assert (tmp_path / "state.safetensors").read_bytes() == saved


# ---------------------------------------------------------------------------------------------- clients
def test_client_ids_follow_partition_ids_and_the_fraction() -> None:
    """Client ids are the nodes' partition-ids (reversed here against the node order); fraction_train and
    min_train_nodes size the rounds as FedAvg's; total_samples given: no query, ids by node order."""
    grid = InProcessGrid(user_client_app(), CLIENTS)
    for node, context in grid.contexts.items():
        context.node_config[wire.PARTITION_ID] = CLIENTS - 1 - grid.partition_of[node]
    seen: list[tuple[int, int]] = []
    base = grid.client_app

    def app(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == "train":
            seen.append((protocol.read_task(msg.content).client, int(context.node_config[wire.PARTITION_ID])))
        return base(msg, context)

    grid.client_app = app
    strategy = dflower.DTurboVBI(TinyNet, overrides=FAST, sparsity=SPARSITY, fraction_train=0.4, min_train_nodes=2,
                                 fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=2)
    assert seen and all(cid == pid for cid, pid in seen)
    assert strategy.session.cfg.federation.clients_per_round == 2
    assert all(m["participants"] == 2 for m in result.train_metrics_clientapp.values())

    grid = InProcessGrid(user_client_app(with_query=False), CLIENTS)
    strategy = dflower.DTurboVBI(TinyNet, overrides=FAST, sparsity=SPARSITY, total_samples=600,
                                 fraction_evaluate=0.0)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=1)
    assert strategy.session.node_of == dict(enumerate(sorted(grid.get_node_ids())))
    assert (0, protocol.QUERY) not in grid.delivered


def test_without_query_or_total_samples_the_error_says_how() -> None:
    grid = InProcessGrid(user_client_app(with_query=False), CLIENTS)
    strategy = dflower.DTurboVBI(TinyNet, overrides=FAST)
    with pytest.raises(RuntimeError, match=r"count_samples.*total_samples"):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=1)


def test_failing_and_mismatched_clients_are_counted() -> None:
    """A ClientApp whose model is another architecture raises (Flower's error reply: clients_failed, its reason
    names both models); an STC node that lost its state replies with the failure reason."""
    def app(msg: Message, context: Context) -> Message:
        pid = context.node_config["partition-id"]
        if msg.metadata.message_type == protocol.QUERY:
            return dflower.count_samples(msg, context, partition(pid))
        model = dturbo.bayesianize(OtherNet() if pid == 0 else TinyNet())
        return dflower.fit(msg, context, model, partition(pid))

    strategy = dflower.DTurboVBI(TinyNet, overrides=FAST, sparsity=SPARSITY, fraction_evaluate=0.0)
    result = strategy.start(grid=InProcessGrid(app, CLIENTS), initial_arrays=ArrayRecord(), num_rounds=1)
    m = result.train_metrics_clientapp[1]
    assert (m["clients_ok"], m["clients_failed"]) == (CLIENTS - 1, 1)

    with pytest.raises(ValueError, match=r"fc 4x12.*body.0 24x12"):
        client_module.runtime(protocol.Task("dturbo", 0, 0, strategy.session.settings, strategy.session.layers),
                              dturbo.bayesianize(OtherNet()))

    def forgetful(pid: int, msg: Message) -> None:  # node 1 restarts before round 2: a fresh process, no state
        if pid == 1 and msg.metadata.message_type == "train" and protocol.read_task(msg.content).round_idx == 1:
            client_module._CACHE.clear()
            context = grid.contexts[grid.node_id(1)]
            for key in list(context.state.keys()):
                del context.state[key]

    grid = InProcessGrid(user_client_app(), CLIENTS, intercept=forgetful)
    stc = dflower.STC(TinyNet, overrides=FAST, p_up=0.1, p_down=0.1, fraction_evaluate=0.0)
    result = stc.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=2)
    m = result.train_metrics_clientapp[2]
    assert (m["clients_ok"], m["clients_failed"]) == (CLIENTS - 1, 1)


def test_client_helper_reads_loaders_and_answers_queries() -> None:
    """fit on a DataLoader (tuples or dict batches) sends the bytes fit on the tensors sends; count_samples tells
    the sample count and partition-id; evaluate puts the global model into the user's model."""
    grid = InProcessGrid(user_client_app(), CLIENTS)
    strategy = dflower.DTurboVBI(TinyNet, overrides=FAST, sparsity=SPARSITY, fraction_evaluate=0.0)
    strategy.setup(grid, ArrayRecord(), 2)
    msgs = list(strategy.configure_train(1, strategy.global_arrays(), ConfigRecord(), grid))
    msg = msgs[0]
    msg.metadata.__dict__["_message_id"] = "m0"
    cid = protocol.read_task(msg.content).client
    x, y = partition(cid)
    ds = torch.utils.data.TensorDataset(x, y)

    class Dicts(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(y)

        def __getitem__(self, i: int) -> dict:
            return {"img": x[i], "label": y[i]}

    replies = []
    for data in ((x, y), (x.numpy(), y.numpy()), ClientData(x, y),
                 torch.utils.data.DataLoader(ds, batch_size=50, shuffle=False),
                 torch.utils.data.DataLoader(Dicts(), batch_size=64)):
        client_module._CACHE.clear()
        model = dturbo.bayesianize(TinyNet())
        context = Context(run_id=1, node_id=1, node_config={wire.PARTITION_ID: cid}, state=RecordDict(), run_config={})
        reply = dflower.fit(msg, context, model, data)
        replies.append(wire.record_bytes(reply.content, wire.UP))
        assert reply.content.metric_records[protocol.METRICS][protocol.NUM_EXAMPLES] == len(y)
        # afterwards the user's model holds the locally trained weights: dense on the round's support
        assert all(torch.count_nonzero(layer.weight_mu) > 0 for _, layer in bayesian_layers(model))
    assert all(r == replies[0] for r in replies)
    with pytest.raises(TypeError, match="batch"):
        client_module.client_data([{"pixels": x[:2]}, {"pixels": x[2:4]}])

    context = Context(run_id=1, node_id=1, node_config={wire.PARTITION_ID: 2}, state=RecordDict(), run_config={})
    query = Message(RecordDict({wire.TASK: ConfigRecord({})}), dst_node_id=1, message_type=protocol.QUERY)
    query.metadata.__dict__["_message_id"] = "q"
    answer = dflower.count_samples(query, context, (x, y))
    assert answer.content.metric_records[protocol.METRICS][protocol.NUM_EXAMPLES] == len(y)
    assert answer.content.config_records[wire.TASK][wire.PARTITION_ID] == 2

    ev = list(strategy.configure_evaluate(1, strategy.global_arrays(), ConfigRecord(), grid))
    assert not ev  # fraction_evaluate = 0
    strategy.fraction_evaluate, strategy.min_evaluate_nodes = 1.0, 1
    ev = list(strategy.configure_evaluate(1, strategy.global_arrays(), ConfigRecord(), grid))
    assert len(ev) == CLIENTS
    ev[0].metadata.__dict__["_message_id"] = "e0"
    model = dturbo.bayesianize(TinyNet())
    reply = dflower.evaluate(ev[0], context, model, (x, y))
    metrics = reply.content.metric_records[protocol.METRICS]
    assert metrics[protocol.NUM_EXAMPLES] == len(y) and 0 <= metrics["eval_acc"] <= 1
    acc, loss = evaluate(model, x, y)
    assert (acc, loss) == (metrics["eval_acc"], metrics["eval_loss"])
    server = strategy.global_model()
    for (_, mine), (_, theirs) in zip(bayesian_layers(model), bayesian_layers(server), strict=True):
        assert torch.equal(mine.mask, theirs.mask)  # the support the server holds
        assert torch.allclose(mine.weight_mu, theirs.weight_mu, atol=0.05)  # its weights, 8-bit quantised


@pytest.mark.parametrize("algorithm", ["stc", "feddst", "fedavg"])
def test_peers_evaluate_the_global_model(algorithm: str) -> None:
    """STC's, FedDST's and FedAvg's evaluate messages carry the global model whole; the helper loads it exactly
    (STC: float32) or to its wire dtype (FedDST, FedAvg: float16)."""
    grid = InProcessGrid(user_client_app(), CLIENTS)
    strategy = dflower.DturboStrategy(TinyNet, algorithm=algorithm, config=runner_config(algorithm, rounds=2),
                                      min_evaluate_nodes=1)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=2)
    assert set(result.evaluate_metrics_clientapp) == {1, 2}
    ev = list(strategy.configure_evaluate(2, strategy.global_arrays(), ConfigRecord(), grid))
    ev[0].metadata.__dict__["_message_id"] = "e0"
    model = dturbo.bayesianize(TinyNet())
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    dflower.evaluate(ev[0], context, model, partition(0))
    tol = 0 if algorithm == "stc" else 1e-3
    for (_, mine), (_, theirs) in zip(bayesian_layers(model), bayesian_layers(strategy.global_model()), strict=True):
        assert torch.allclose(mine.weight_mu * mine.mask, theirs.weight_mu * theirs.mask, atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------- settings
def test_settings_presets_and_initial_arrays() -> None:
    s = dflower.DTurboVBI(TinyNet, preset="quick", beta=0.02, sparsity={"target_density": 0.1},
                          overrides={"train.lr": 0.003})
    cfg = s.config_for(num_rounds=5, clients=4)
    assert (cfg.dturbo.beta, cfg.dturbo.sparsity.target_density) == (0.02, 0.1)
    assert (cfg.dturbo.sparsity.warmup_rounds, cfg.dturbo.sparsity.ramp_rounds) == (1, 7)  # the preset's, kept
    assert (cfg.experiment.rounds, cfg.federation.clients, cfg.federation.clients_per_round) == (5, 4, None)
    assert cfg.train.lr == 0.003 and cfg.train.batch_size == 64
    assert protocol.parse_settings(protocol.settings_text(cfg)) == cfg
    assert len(protocol.settings_text(cfg)) < 400
    assert dflower.STC(TinyNet, preset="stc").config_for(3, 3).stc.p_up == 0.1
    with pytest.raises(ConfigError, match="target_densty"):
        dflower.DTurboVBI(TinyNet, sparsity={"target_densty": 0.1})
    with pytest.raises(ConfigError, match="'stc'"):
        dflower.DTurboVBI(TinyNet, preset="stc")
    with pytest.raises(ValueError, match="algorithm 'fedpm'"):  # its client cannot load a model without training
        dflower.DturboStrategy(TinyNet, algorithm="fedpm")

    # initial_arrays: of the plain model or of the Bayesian one; the server starts from those weights
    cfg = s.config_for(3, 3)
    plain = TinyNet()
    model = s.initial_model(cfg, ArrayRecord(plain.state_dict()))
    assert torch.equal(model.head.weight_mu, plain.head.weight)
    bayes = dturbo.bayesianize(TinyNet())
    model = s.initial_model(cfg, ArrayRecord(bayes.state_dict()))
    assert torch.equal(model.head.weight_mu, bayes.head.weight_mu)
    with pytest.raises(ValueError, match="initial_arrays"):
        s.initial_model(cfg, ArrayRecord(OtherNet().state_dict()))
    # a seeded factory: the same initial weights every time
    a, b = s.initial_model(cfg), s.initial_model(cfg)
    assert torch.equal(a.head.weight_mu, b.head.weight_mu)


class EmptyShapeNet(TinyNet):
    """TinyNet that records an empty sample shape, as a model written for several inputs may."""

    def __init__(self) -> None:
        super().__init__()
        self.input_shape: tuple[int, ...] = ()


def test_the_strategys_input_shape_fills_an_empty_recorded_one_and_keeps_a_real_one() -> None:
    """input_shape= is recorded where the model records none, an empty shape included (the cut reads the graph on
    it: an empty shape would cut nothing); a shape the model records is the user's, kept."""
    s = dflower.DTurboVBI(EmptyShapeNet, input_shape=(12,), dead_units="cut")
    cfg = s.config_for(3, 3)
    model = s.initial_model(cfg)
    assert model.input_shape == (12,)
    assert DeadUnits(model, layer_infos(model, cfg)).links, "the cut reads the graph on the filled shape"
    # the runner's factory of a user's model fills it alike
    factory = user_model_factory(EmptyShapeNet, sigma_mode="layer", sigma_init_ratio=0.02, seed=0, input_shape=(12,))
    assert factory().input_shape == (12,)
    recorded = TinyNet()
    recorded.input_shape = (1, 12)
    assert dflower.DTurboVBI(recorded, input_shape=(12,)).initial_model(cfg).input_shape == (1, 12)

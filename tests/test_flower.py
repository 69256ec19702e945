"""The same algorithms on Flower: the ServerApp/ClientApp make the same run directory as ``dturbo run``.

In process (an InProcessGrid hands each message to the ClientApp callable) for equality with the Simulator,
faults (a client that raises, a node that never replies or goes away, too few clients and resume); and real
deployments on loopback: a SuperLink and three SuperNodes started here, ``flwr run`` on this repository, once
undisturbed and once with a SuperNode killed in the middle of the run.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import tomli_w
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install -e '.[flower]')")

from flwr.app import Context, Message, RecordDict  # noqa: E402
from run_helpers import rows_of  # noqa: E402

from dturbo.algorithms.base import ClientAlgorithm, ClientError  # noqa: E402
from dturbo.checkpoint import load_checkpoint  # noqa: E402
from dturbo.flower import client_app as client_module  # noqa: E402
from dturbo.flower import wire  # noqa: E402
from dturbo.flower.inprocess import InProcessGrid, run_inprocess  # noqa: E402
from dturbo.flower.server_app import server_settings  # noqa: E402
from dturbo.settings import load_config  # noqa: E402
from dturbo.sim import CLIENT_STATE_PREFIX, Simulator, TooFewClientsError  # noqa: E402
from dturbo.transport import ClientLost  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(600)


def write_config(folder: Path, toy: Path, algorithm: str = "dturbo", rounds: int = 3, clients: int = 4,
                 **sections: dict) -> Path:
    cfg: dict = {
        "experiment": {"seed": 3, "rounds": rounds, "threads": 1, "algorithm": algorithm},
        "data": {"name": "npz", "path": str(toy)},
        "federation": {"clients": clients, "alpha": 1.0},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"local_steps": 5, "lr": 0.01},
        "dturbo": {"beta": 0.01, "sparsity": {"target_density": 0.4, "warmup_rounds": 1, "ramp_rounds": 2}},
        "dssm": {"min_clients": 2},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{algorithm}.toml"
    path.write_text(tomli_w.dumps(cfg))
    return path


def assert_same_model(a: Path, b: Path) -> None:
    """The same tensors (bitwise) and metadata; the file bytes may differ (safetensors' header order)."""
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        assert fa.metadata() == fb.metadata() and sorted(fa.keys()) == sorted(fb.keys())
        for k in fa.keys():
            assert torch.equal(fa.get_tensor(k), fb.get_tensor(k)), k


def assert_same_metrics(a: Path, b: Path) -> None:
    """Every column equal (the same bytes crossed, the same floats came out), timing columns aside."""
    ra, rb = rows_of(a), rows_of(b)
    assert [list(r) for r in ra] == [list(r) for r in rb]
    assert len(ra) == len(rb) > 0
    for x, y in zip(ra, rb, strict=True):
        bits = {k: (x[k], y[k]) for k in x if k.endswith("bits") and x[k] != y[k]}
        assert not bits, f"round {x['round']}: bit columns differ: {bits}"
        others = {k: (x[k], y[k]) for k in x if x[k] != y[k]}
        assert not others, f"round {x['round']}: {others}"


# ------------------------------------------------------------------ in process
@pytest.mark.parametrize("algorithm", ["dturbo", "fedavg", "fedpaq", "dssm"])
def test_inprocess_flower_run_equals_simulator(tmp_path, toy, algorithm):
    path = write_config(tmp_path, toy, algorithm)
    Simulator(load_config(path), tmp_path / "sim").run()
    grid = run_inprocess(path, tmp_path / "flower")
    assert_same_metrics(tmp_path / "sim", tmp_path / "flower")
    sim, flower = tmp_path / "sim", tmp_path / "flower"
    assert (sim / "config.toml").read_text() == (flower / "config.toml").read_text()
    assert_same_model(sim / "model.safetensors", flower / "model.safetensors")
    state_a, counters_a = load_checkpoint(sim / "checkpoint")
    state_b, counters_b = load_checkpoint(flower / "checkpoint")
    # the clients' private state (the supports they hold, STC's residuals) is in the simulator's checkpoint; on
    # Flower it stays on the nodes (Context.state): the server's state is the same
    state_a = {k: v for k, v in state_a.items() if not k.startswith(CLIENT_STATE_PREFIX)}
    assert counters_a == counters_b and state_a.keys() == state_b.keys()
    assert all(np.array_equal(state_a[k], state_b[k]) for k in state_a)
    if algorithm == "dturbo":  # the heat-map messages too
        msgs = sorted((sim / "messages").iterdir())
        assert msgs and [m.name for m in msgs] == sorted(m.name for m in (flower / "messages").iterdir())
        for m in msgs:
            assert_same_model(m, flower / "messages" / m.name)
    # one discovery query per node, then one train message per selected client and round
    kinds = [k for _, k in grid.delivered]
    assert kinds.count(wire.PARTITION_QUERY) == 4
    assert kinds.count("train") == sum(int(r["participants"]) for r in rows_of(tmp_path / "sim"))


class Scripted:
    """A transport: the in-process clients with the same client failures as a Flower run of the fault tests."""

    def __init__(self, inner, outcomes: dict[tuple[int, int], ClientError]) -> None:
        self.inner = inner
        self.outcomes = outcomes

    def __call__(self, downlinks, rnd):
        answers = self.inner({c: d for c, d in downlinks.items() if (rnd, c) not in self.outcomes}, rnd)
        return {c: self.outcomes[(rnd, c)] if (rnd, c) in self.outcomes else answers[c] for c in downlinks}


def scripted(cfg, out: Path, outcomes: dict[tuple[int, int], ClientError]) -> Simulator:
    """The in-process reference whose clients fail as ``outcomes`` says."""
    sim = Simulator(cfg, out)
    sim.transport = Scripted(sim.transport, outcomes)
    return sim


def test_failing_and_silent_clients_are_dropped_and_recorded(tmp_path, toy, monkeypatch):
    """Round 2: client 0's algorithm fails (ClientError), client 1's ClientApp raises, client 2's node never
    replies: the round completes with client 3 alone, exactly as the Simulator does with those failures."""
    path = write_config(tmp_path, toy, "dturbo", rounds=3)
    diverge = {"on": False}
    real_runtime = client_module.client_runtime

    class Diverging(ClientAlgorithm):
        def __init__(self, inner):
            self.inner = inner

        def fit(self, down, data, cid):
            if diverge["on"] and cid == 0:
                raise ClientError("local training diverged (loss is NaN)")
            return self.inner.fit(down, data, cid)

    def runtime(*args, **kwargs):
        rt = real_runtime(*args, **kwargs)
        return client_module.ClientRuntime(rt.cfg, rt.federation, Diverging(rt.client))

    monkeypatch.setattr(client_module, "client_runtime", runtime)

    def flaky(msg: Message, context: Context) -> Message:
        pid = context.node_config[wire.PARTITION_ID]
        if msg.metadata.message_type == "train" and int(msg.content["task"]["round"]) == 1 and pid == 1:
            raise RuntimeError("disk on fire")
        return client_module.app(msg, context)

    def intercept(pid: int, msg: Message) -> str | None:
        train_round = int(msg.content["task"]["round"]) if msg.metadata.message_type == "train" else -1
        diverge["on"] = train_round == 1
        return "silent" if (train_round, pid) == (1, 2) else None

    grid = InProcessGrid(flaky, 4, intercept=intercept)
    run_inprocess(path, tmp_path / "flower", grid=grid)

    outcomes = {(1, 0): ClientError("x"), (1, 1): ClientError("x"), (1, 2): ClientLost("x")}
    scripted(load_config(path), tmp_path / "sim", outcomes).run()
    assert_same_metrics(tmp_path / "sim", tmp_path / "flower")

    rows = rows_of(tmp_path / "flower")
    assert [(r["clients_failed"], r["clients_dropped"], r["clients_ok"]) for r in rows] == [
        ("0", "0", "4.0"), ("2", "1", "1.0"), ("0", "0", "4.0")]
    events = (tmp_path / "flower" / "events.log").read_text().splitlines()
    assert events == [
        "round 2: client 0: local training diverged (loss is NaN)",
        f"round 2: client 1: ClientApp failed (Flower error 2): {RuntimeError}:<'disk on fire'>",
        f"round 2: client 2: did not answer (no reply from node {grid.node_id(2)} within 3600 s)",
    ]
    # nothing saved is lost: every round checkpointed, the model written
    _, counters = load_checkpoint(tmp_path / "flower" / "checkpoint")
    assert counters["rounds_done"] == 3
    assert (tmp_path / "flower" / "model.safetensors").stat().st_size > 0


def test_node_that_leaves_and_rejoins_under_a_new_id(tmp_path, toy):
    """A node gone before a round counts as dropped; one that disappears while the round's message waits
    (Flower's NODE_UNAVAILABLE reply) too; a node back under a new node id is found again by its partition-id."""
    path = write_config(tmp_path, toy, "fedavg", rounds=4)

    def intercept(pid: int, msg: Message) -> str | None:
        rnd = int(msg.content["task"]["round"]) if msg.metadata.message_type == "train" else -1
        if (rnd, pid) == (0, 3):
            grid.offline.add(3)  # leaves after answering round 1
        if (rnd, pid) == (1, 0):
            grid.reconnect(3)  # back during round 2, under a new node id
        return "offline" if (rnd, pid) == (2, 1) else None

    grid = InProcessGrid(client_module.app, 4, intercept=intercept)
    old_node = grid.node_id(3)
    run_inprocess(path, tmp_path / "flower", grid=grid)
    assert grid.node_id(3) != old_node
    rows = rows_of(tmp_path / "flower")
    assert [int(r["clients_dropped"]) for r in rows] == [0, 1, 1, 0]
    assert [float(r["clients_ok"]) for r in rows] == [4, 3, 3, 4]
    events = (tmp_path / "flower" / "events.log").read_text().splitlines()
    assert events == [
        "round 2: client 3: did not answer (no SuperNode with partition-id=3 is connected)",
        f"round 3: client 1: did not answer (Flower error 5: node {grid.node_id(1)} is offline)",
    ]
    kinds = [k for _, k in grid.delivered]
    assert kinds.count(wire.PARTITION_QUERY) == 6  # 4 at the start, node 3 again, node 1 again
    assert (tmp_path / "flower" / "model.safetensors").exists()


def test_too_few_clients_keeps_the_checkpoint_and_resume_finishes_the_same_run(tmp_path, toy):
    path = write_config(tmp_path, toy, "dturbo", rounds=3,
                        federation={"min_clients": 2, "on_too_few": "stop"})
    Simulator(load_config(path), tmp_path / "sim").run()

    def silent_in_round_2(pid: int, msg: Message) -> str | None:
        is_train = msg.metadata.message_type == "train"
        return "silent" if is_train and int(msg.content["task"]["round"]) == 1 and pid != 0 else None

    out = tmp_path / "flower"
    grid = InProcessGrid(client_module.app, 4, intercept=silent_in_round_2)
    with pytest.raises(TooFewClientsError, match="round 2"):
        run_inprocess(path, out, grid=grid)
    _, counters = load_checkpoint(out / "checkpoint")
    assert counters["rounds_done"] == 1 and len(rows_of(out)) == 1
    assert "fewer than federation.min_clients = 2" in (out / "events.log").read_text()

    run_inprocess(path, out, resume=True)  # every node healthy again
    assert_same_metrics(tmp_path / "sim", out)
    assert_same_model(tmp_path / "sim" / "model.safetensors", out / "model.safetensors")


def test_run_config_is_checked(tmp_path):
    with pytest.raises(ValueError, match="config and out"):
        server_settings({})
    with pytest.raises(ValueError, match="round-timeout"):
        server_settings({"config": "a.toml", "out": "o", "round-timeout": -1.0})
    s = server_settings({"config": "a.toml", "out": "o", "resume": True, "round-timeout": 0.0})
    assert s["config"].is_absolute() and s["resume"] is True and s["round-timeout"] == 0.0


def test_node_config_and_bytes_on_the_wire():
    data = bytes(range(256)) * 3
    assert wire.record_bytes(RecordDict({"up": wire.bytes_record(data)}), "up") == data
    # over a bound: its first bound + 1 bytes (what the server books and refuses), read from the .npy in place
    assert wire.record_bytes(RecordDict({"up": wire.bytes_record(data)}), "up", max_bytes=100) == data[:101]
    assert wire.record_bytes(RecordDict({"up": wire.bytes_record(data)}), "up", max_bytes=len(data)) == data
    with pytest.raises(wire.WireError, match="no ArrayRecord"):
        wire.record_bytes(RecordDict(), "up")
    ctx = Context(run_id=1, node_id=5, node_config={}, state=None, run_config={})
    with pytest.raises(wire.WireError, match="partition-id"):
        wire.partition_of(ctx)
    ctx.node_config = {"partition-id": 2, "num-partitions": 4}
    assert wire.partition_of(ctx) == (2, 4)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pathspec, inside flwr's FAB build
def test_pyproject_is_a_valid_flower_app():
    import tomllib

    from flwr.cli.build import build_fab_from_disk
    from flwr.common.config import validate_config

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ok, errors, _ = validate_config(config, check_module=True, project_dir=ROOT)
    assert ok, errors
    assert "federations" not in config["tool"]["flwr"]  # flwr would migrate (rewrite) pyproject.toml
    extras = config["project"]["optional-dependencies"]
    assert extras["flower"] == ["flwr==1.41.0"] and extras["simulation"] == ["flwr[simulation]==1.41.0"]
    assert '".[test,flower,simulation]"' in (ROOT / "scripts" / "setup.sh").read_text()  # CI runs the simulation
    fab = build_fab_from_disk(ROOT)
    assert len(fab) < 200_000


# ------------------------------------------------------------------ real deployment on loopback
def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _descendants(pid: int) -> list[int]:
    """pid's children, grandchildren, ... (from /proc), deepest last."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie is not: it only waits for its parent, maybe an init that never reaps)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stop(procs: list[subprocess.Popen], signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGKILL)) -> None:
    """Terminate the processes started here and everything they started (flower-superexec, flwr-*app), or
    with ``signals=(SIGKILL,)`` kill them outright. One already reaped is skipped: its pid may be another's now."""
    pids = []
    for p in procs:
        if p.poll() is None:
            pids += [p.pid, *_descendants(p.pid)]  # the whole tree first: orphans would be reparented
    for sig in signals:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            for p in procs:
                p.poll()  # reap our own children
            time.sleep(0.1)
    for p in procs:
        p.poll()


def _freeze(pid: int) -> None:
    """SIGSTOP pid and its descendants, again for any started meanwhile: a frozen tree starts nothing new."""
    frozen: set[int] = set()
    while new := {pid, *_descendants(pid)} - frozen:
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        frozen |= new


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class Loopback:
    """A SuperLink and SuperNodes (partition-id 0, 1, ...) on 127.0.0.1: subprocesses started here, ``--insecure``
    on free ports, each logging to ``folder/logs/<name>.log``; :meth:`flwr_run` starts this repository's app."""

    def __init__(self, folder: Path, tools: dict[str, str], nodes: int) -> None:
        self.tools = tools
        self.folder = folder
        self.logdir = folder / "logs"
        self.logdir.mkdir()
        self.link_port, *self.node_ports = _free_ports(nodes + 1)
        home = folder / "flwr-home"
        home.mkdir()
        (home / "config.toml").write_text(tomli_w.dumps({"superlink": {
            "default": "loopback", "loopback": {"address": f"127.0.0.1:{self.link_port}", "insecure": True}}}))
        bindir = Path(tools["flwr"]).parent
        self.env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "FLWR_HOME": str(home),
                    "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2"}
        self.procs: list[subprocess.Popen] = []
        self.nodes: list[subprocess.Popen] = []  # by partition-id
        self._files: list = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        self._files.append(log := open(self.logdir / f"{name}.log", "w"))
        proc = subprocess.Popen(args, cwd=self.folder, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def up(self) -> None:
        link = self.start("superlink", [self.tools["flower-superlink"], "--insecure",
                                        "--disable-runtime-dependency-installation",
                                        "--host", "127.0.0.1", "--port", str(self.link_port)])
        _wait_port(self.link_port, link)
        for pid, port in enumerate(self.node_ports):
            self.nodes.append(self.start(f"supernode{pid}", [
                self.tools["flower-supernode"], "--insecure", "--superlink", f"127.0.0.1:{self.link_port}",
                "--port", str(port), "--node-config", f"partition-id={pid} num-partitions={len(self.node_ports)}"]))

    def flwr_run(self, config: Path, out: Path, **run_config: float) -> subprocess.Popen:
        """``flwr run`` of this repository's app (``--stream``: its log is ``flwr-run.log``); run_config keys
        with ``_`` for ``-`` (round_timeout=...)."""
        items = {"config": str(config), "out": str(out), **{k.replace("_", "-"): v for k, v in run_config.items()}}
        return self.start("flwr-run", [self.tools["flwr"], "run", str(ROOT), "loopback", "--run-config",
                                       " ".join(f"{k}={v!r}" for k, v in items.items()), "--stream"])

    def wait(self, proc: subprocess.Popen, timeout: float, what: str) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{what} did not finish in {timeout} s\n{self.logs()}")

    def kill_node(self, pid: int) -> None:
        """SIGKILL SuperNode ``pid`` with its whole process tree (SuperExec, a ClientApp if one runs): gone without
        a word to the SuperLink, as when its machine dies."""
        _freeze(self.nodes[pid].pid)
        _stop([self.nodes[pid]], signals=(signal.SIGKILL,))

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text()

    def logs(self) -> str:
        return "\n".join(f"==== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logdir.iterdir()))

    def close(self) -> None:
        _stop(self.procs)
        for f in self._files:
            f.close()


@contextmanager
def loopback(folder: Path, nodes: int = 3) -> Iterator[Loopback]:
    """A running :class:`Loopback` with ``nodes`` SuperNodes; every process it started is stopped on exit."""
    bindir = Path(sys.executable).parent
    tools = {name: shutil.which(name, path=str(bindir)) for name in ("flower-superlink", "flower-supernode", "flwr")}
    if not all(tools.values()):
        pytest.skip(f"Flower's commands are missing next to {sys.executable}: {tools}")
    net = Loopback(folder, tools, nodes)
    try:
        net.up()
        yield net
    finally:
        net.close()


@pytest.mark.slow
def test_deployment_on_loopback_equals_simulator(tmp_path, toy):
    """A SuperLink and 3 SuperNodes (subprocesses), `flwr run` of this repository's app: 2 rounds of
    D-Turbo-VBI with the same metrics as the in-process Simulator."""
    path = write_config(tmp_path, toy, "dturbo", rounds=2, clients=3)
    Simulator(load_config(path), tmp_path / "sim").run()
    out = tmp_path / "run"
    t0 = time.monotonic()
    with loopback(tmp_path) as net:
        rc = net.wait(net.flwr_run(path, out, round_timeout=120.0, connect_timeout=60.0), 240, "flwr run")
        seconds = time.monotonic() - t0
    assert rc == 0 and (out / "model.safetensors").exists(), net.logs()
    assert_same_metrics(tmp_path / "sim", out)
    assert_same_model(tmp_path / "sim" / "model.safetensors", out / "model.safetensors")
    assert "round 2/2" in net.log("flwr-run")
    print(f"deployment: 2 rounds in {seconds:.0f} s")


ROUND_TIMEOUT = 60.0  # a healthy round takes 15-20 s with 3 ClientApps on 2 cores, 30 s and more beside another test


@pytest.mark.slow
def test_deployment_supernode_killed_mid_round(tmp_path, toy):
    """SuperNode 2 SIGKILLed (with its SuperExec and any ClientApp) in the middle of a real deployment of 3 rounds:
    rounds 2 and 3 complete with clients 0 and 1, client 2 counted and logged as dropped, nothing saved is lost.

    The kill comes as soon as round 1's row is in metrics.csv, i.e. when the ServerApp sends round 2's messages:
    SuperNode 2 normally has not pulled its message yet (an idle SuperNode polls every 3 s; the test prints which
    moment it hit), so the message waits at the SuperLink until ``round-timeout``. Had it been pulled, its
    ClientApp died with the node and no reply comes either: the same outcome. In round 3 the SuperLink may still
    list the node (it misses heartbeats only after 60 s): then that message times out too, or comes back as
    Flower's NODE_UNAVAILABLE; once unlisted, the node is not even sent one. Each way client 2 "did not answer".
    The result equals the in-process Simulator's with client 2 lost in rounds 2 and 3: round 1 as without any
    loss, then the aggregation over clients 0 and 1 (p_t renormalised over them), the same model and checkpoint.
    """
    path = write_config(tmp_path, toy, "dturbo", rounds=3, clients=3)
    lost = ClientLost("SuperNode killed")
    scripted(load_config(path), tmp_path / "ref", {(1, 2): lost, (2, 2): lost}).run()
    out = tmp_path / "run"
    metrics = out / "metrics.csv"
    t0 = time.monotonic()
    with loopback(tmp_path) as net:
        run = net.flwr_run(path, out, round_timeout=ROUND_TIMEOUT, connect_timeout=60.0)
        deadline = time.monotonic() + 240
        while len((saved := metrics.read_text() if metrics.exists() else "").splitlines()) < 2:
            if run.poll() is not None:
                pytest.fail(f"flwr run exited with {run.returncode} before round 1 ended\n{net.logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"round 1 did not end in 240 s\n{net.logs()}")
            time.sleep(0.1)
        net.kill_node(2)
        killed = time.monotonic()
        _, round2, after = net.log("supernode2").partition("ROUND 2]")
        moment = ("while its ClientApp ran round 2" if "flwr-clientapp" in after else
                  "after it pulled round 2's message" if round2 else "before it pulled round 2's message")
        assert len(saved.splitlines()) == 2, f"killed too late: round 2 had ended\n{saved}"
        rc = net.wait(run, 2 * ROUND_TIMEOUT + 120, "flwr run after the kill")
        seconds = time.monotonic() - t0
    logs = net.logs()
    assert rc == 0, logs
    rows = rows_of(out)
    assert [(r["round"], r["participants"], r["clients_ok"], r["clients_dropped"], r["clients_failed"])
            for r in rows] == [("1", "3", "3.0", "0", "0"), ("2", "3", "2.0", "1", "0"), ("3", "3", "2.0", "1", "0")], (
        f"{rows}\n{(out / 'events.log').read_text() if (out / 'events.log').exists() else ''}\n{logs}")
    events = (out / "events.log").read_text().splitlines()
    assert [e.split(": did not answer (")[0] for e in events] == ["round 2: client 2", "round 3: client 2"], events
    assert_same_metrics(tmp_path / "ref", out)  # round 1 = the Simulator's, rounds 2-3 over clients 0 and 1
    assert all(np.isfinite(float(r["accuracy"])) for r in rows)
    assert metrics.read_text().splitlines()[:2] == saved.splitlines()  # round 1's row as written, timing too
    assert_same_model(tmp_path / "ref" / "model.safetensors", out / "model.safetensors")
    _, counters = load_checkpoint(out / "checkpoint")
    assert counters["rounds_done"] == 3 and counters == load_checkpoint(tmp_path / "ref" / "checkpoint")[1]
    print(f"SuperNode 2 killed {moment}, {killed - t0:.0f} s in; 3 rounds in {seconds:.0f} s; events: {events}")

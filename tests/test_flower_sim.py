"""Flower's simulation engine: ``flwr run . local-sim`` with 100 virtual SuperNodes runs this repository's app.

The connection is the one docs/flower.md tells users to put in ``$FLWR_HOME/config.toml`` (read from the doc),
in a temporary FLWR_HOME; ``flwr run`` starts the local simulation SuperLink itself (on a free port here), which
runs the ServerApp and the ClientApps on Ray workers. The run directory must equal the in-process Simulator's,
for D-Turbo-VBI and for STC (client state in ``Context.state`` while Ray workers share the virtual nodes); a
federation whose size does not match ``federation.clients`` must stop with an error saying so. Needs the
``simulation`` extra (``flwr[simulation]``: Ray); skipped without it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install -e '.[flower]')")
pytest.importorskip("ray", reason="Flower's simulation engine is not installed (pip install -e '.[simulation]': "
                                  "flwr[simulation]==1.41.0, i.e. ray)")

from test_flower import (  # noqa: E402
    _alive,
    _descendants,
    _free_ports,
    assert_same_metrics,
    assert_same_model,
    rows_of,
    write_config,
)

from dturbo.settings import load_config  # noqa: E402
from dturbo.sim import Simulator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = 100


def documented_connection() -> str:
    """The ``[superlink.local-sim]`` TOML block of docs/flower.md, as written there."""
    blocks = re.findall(r"```toml\n(.*?)```", (ROOT / "docs" / "flower.md").read_text(), flags=re.S)
    found = [b for b in blocks if "[superlink.local-sim]" in b]
    assert len(found) == 1, "docs/flower.md must show the local-sim connection once"
    return found[0]


def superlinks_on(port: int) -> list[int]:
    """Process ids of the local simulation SuperLink that ``flwr run`` started (detached) on ``port``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"flower-superlink") for a in args[:2]) and b"--simulation" in args \
                    and str(port).encode() in args:
                pids.append(int(entry.name))
    return pids


class LocalSim:
    """``flwr run`` against the documented local-sim connection, with FLWR_HOME and the SuperLink's port private."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        home = folder / "flwr-home"
        home.mkdir()
        (home / "config.toml").write_text('[superlink]\ndefault = "local-sim"\n\n' + documented_connection())
        self.port = _free_ports(1)[0]
        bindir = Path(sys.executable).parent
        self.flwr = bindir / "flwr"
        self.env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
                    "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(self.port), "OMP_NUM_THREADS": "1"}
        self.runs = 0

    def run(self, config: Path, out: Path, *extra: str, timeout: float = 300) -> tuple[int, str]:
        """``flwr run ROOT local-sim --stream``: its exit code and output."""
        self.runs += 1
        rc_items = {"config": str(config), "out": str(out), "connect-timeout": 30.0}
        args = [str(self.flwr), "run", str(ROOT), "local-sim", "--stream", *extra,
                "--run-config", " ".join(f"{k}={v!r}" for k, v in rc_items.items())]
        try:
            done = subprocess.run(args, cwd=self.folder, env=self.env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as err:
            pytest.fail(f"flwr run did not finish in {timeout} s\n{err.stdout}\n{err.stderr}\n{self.superlink_log()}")
        return done.returncode, done.stdout + done.stderr

    def superlink_log(self) -> str:
        log = self.folder / "flwr-home" / "local-superlink" / "superlink.log"
        return log.read_text()[-3000:] if log.exists() else "(no SuperLink log)"

    def close(self) -> None:
        """Stop the detached SuperLink that ``flwr run`` started here (found by its private port), and its tree."""
        for pid in superlinks_on(self.port):
            procs = [pid, *_descendants(pid)]
            for sig_pid in procs:
                try:
                    os.kill(sig_pid, 15)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(_alive(p) for p in procs):
                time.sleep(0.2)
            for p in procs:
                if _alive(p):
                    os.kill(p, 9)


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> Iterator[LocalSim]:
    local = LocalSim(tmp_path_factory.mktemp("flwr-sim"))
    try:
        yield local
    finally:
        local.close()


@pytest.fixture(scope="module")
def toy100(make_toy) -> Path:
    return make_toy(3000)  # 30 samples per client


def sim_config(folder: Path, toy: Path, algorithm: str, rounds: int, clients: int = CLIENTS) -> Path:
    return write_config(folder, toy, algorithm, rounds=rounds, clients=clients,
                        federation={"partition": "iid"}, train={"local_steps": 2})


def check_run(tmp_path: Path, output: str, rounds: int, clients: int) -> None:
    """The Flower run in tmp_path/run equals the Simulator's in tmp_path/ref (``flwr run`` exits with 0 even
    when the run failed: the run directory is the evidence)."""
    assert f"({clients} simulated SuperNodes)" in output, output
    assert f"round {rounds}/{rounds}" in output, output
    assert_same_metrics(tmp_path / "ref", tmp_path / "run")
    assert_same_model(tmp_path / "ref" / "model.safetensors", tmp_path / "run" / "model.safetensors")
    assert [int(r["participants"]) for r in rows_of(tmp_path / "run")] == [clients] * rounds


@pytest.mark.slow
def test_simulation_engine_100_clients_equals_simulator(tmp_path, sim, toy100):
    """D-Turbo-VBI on the documented federation, 100 virtual SuperNodes, every client every round: the same
    metrics, bits and model as in process."""
    path = sim_config(tmp_path, toy100, "dturbo", rounds=2)
    Simulator(load_config(path), tmp_path / "ref").run()
    t0 = time.monotonic()
    rc, output = sim.run(path, tmp_path / "run")
    seconds = time.monotonic() - t0
    assert rc == 0, f"{output}\n{sim.superlink_log()}"
    check_run(tmp_path, output, rounds=2, clients=CLIENTS)
    print(f"simulation engine: {CLIENTS} clients, 2 rounds of D-Turbo-VBI in {seconds:.0f} s")


@pytest.mark.slow
def test_simulation_engine_client_state_and_federation_config(tmp_path, sim, toy100):
    """STC (each client's model copy and residual in its node's Context.state, while two Ray workers take the
    virtual nodes in turn) on 10 nodes set with ``--federation-config``: equal to the Simulator too."""
    path = sim_config(tmp_path, toy100, "stc", rounds=3, clients=10)
    Simulator(load_config(path), tmp_path / "ref").run()
    rc, output = sim.run(path, tmp_path / "run", "--federation-config", "num-supernodes=10 client-resources-num-cpus=1")
    assert rc == 0, f"{output}\n{sim.superlink_log()}"
    check_run(tmp_path, output, rounds=3, clients=10)


@pytest.mark.slow
def test_simulation_size_must_match_the_clients(tmp_path, sim, toy100):
    """A 10-client experiment on the 100-node federation: stopped before anything is written, with an error
    naming both numbers and the setting to change."""
    path = sim_config(tmp_path, toy100, "fedavg", rounds=1, clients=10)
    _, output = sim.run(path, tmp_path / "run")
    assert ("ValueError: the simulation federation has 100 SuperNodes but the configuration has "
            "federation.clients = 10: one SuperNode per client is needed (flwr run . <connection> "
            "--federation-config 'num-supernodes=10'") in output, output
    assert not (tmp_path / "run").exists()

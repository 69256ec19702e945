"""Hostile or broken run files and settings: a checkpoint whose header was edited, two runs into one folder, tampered
run files, a full disk, symbolic links, settings that cannot be right, a partition-id two Flower nodes claim. Each
gives a clear error (or a refusal in events.log), never a traceback or a silent resume."""

from __future__ import annotations

import copy
import errno
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dturbo.checkpoint import STATE_FILE, CheckpointError, CheckpointWarning, load_checkpoint, save_checkpoint
from dturbo.cli import app
from dturbo.config import ConfigError
from dturbo.rundir import RunDir, RunDirError, RunDirLocked
from dturbo.settings import parse_config
from dturbo.sim import Simulator


@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(300)


def config(toy: Path, rounds: int = 2, **sections) -> dict:
    cfg = {
        "experiment": {"seed": 1, "rounds": rounds, "threads": 1, "algorithm": "fedavg"},
        "data": {"name": "npz", "path": str(toy)},
        "federation": {"clients": 3, "partition": "iid"},
        "model": {"name": "mlp", "hidden": [8]},
        "train": {"local_steps": 2, "lr": 0.01},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


# ------------------------------------------------------------------------------------------ checkpoints
def _edit_header(path: Path, edit) -> None:
    """Rewrite the JSON header of a safetensors file (its length kept by padding with spaces)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n, "the edit must not lengthen the header"
    path.write_bytes(raw[:8] + text.ljust(n) + raw[8 + n:])


@pytest.mark.parametrize("edit", ["counters", "swap", "dtype"])
def test_an_edited_checkpoint_header_is_refused(tmp_path, edit):
    folder = tmp_path / "checkpoint"
    state = {"a.mu": np.arange(6, dtype=np.float32), "a.pi": np.ones(6, dtype=np.float32)}
    save_checkpoint(folder, state, {"rounds_done": 3, "cum_bits": 11_110_000.0, "fingerprint": "f"})
    path = folder / STATE_FILE

    def change(header: dict) -> None:
        if edit == "counters":
            counters = json.loads(header["__metadata__"]["counters"])
            header["__metadata__"]["counters"] = json.dumps(counters | {"cum_bits": 1_320_000.0})
        elif edit == "swap":
            header["a.mu"], header["a.pi"] = header["a.pi"], header["a.mu"]
        else:
            header["a.pi"]["dtype"] = "I32"

    _edit_header(path, change)
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match="does not match the sha256 checksum"):
        load_checkpoint(folder)
    assert path.read_bytes() == before


def test_a_run_whose_checkpoint_lost_its_checksum_resumes_only_when_asked_by_name(tmp_path, toy):
    """The attack: delete the checksum key, then edit anything. --resume refuses it and leaves the run as it was;
    --resume-unverified (an older dturbo's checkpoint one trusts) continues it, with a warning."""
    cfg = config(toy, rounds=3)
    Simulator(parse_config(config(toy, rounds=2)), tmp_path / "run").run()
    (tmp_path / "run" / "config.toml").write_text((tmp_path / "run" / "config.toml").read_text().replace(
        "rounds = 2", "rounds = 3"))
    path = tmp_path / "run" / "checkpoint" / STATE_FILE
    _edit_header(path, lambda h: h["__metadata__"].pop("sha256_file"))
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match="no checksum, not one of the whole file"):
        Simulator(parse_config(cfg), tmp_path / "run", resume=True).run()
    assert path.read_bytes() == before
    out = CliRunner().invoke(app, ["run", "--out", str(tmp_path / "run"), "--resume-unverified", "--no-figures",
                                   str(tmp_path / "run" / "config.toml")])
    assert out.exit_code == 0, out.output
    assert "cannot be verified" in out.output
    assert len((tmp_path / "run" / "metrics.csv").read_text().splitlines()) == 4


def test_a_checkpoint_whose_checksum_covers_only_its_tensors_loads_with_a_warning(tmp_path):
    import hashlib

    from safetensors.numpy import save

    folder = tmp_path / "checkpoint"
    folder.mkdir()
    state = {"w": np.ones(4, np.float32)}
    data = save(state, metadata={"counters": json.dumps({"rounds_done": 1}), "sha256": "?" * 64})
    start = 8 + int.from_bytes(data[:8], "little")
    digest = hashlib.sha256(data[start:]).hexdigest()
    (folder / STATE_FILE).write_bytes(data[:start].replace(b"?" * 64, digest.encode()) + data[start:])
    with pytest.raises(CheckpointError, match="has a checksum of its tensors only"):
        load_checkpoint(folder)
    with pytest.warns(CheckpointWarning, match="covers its tensors, not its header"):
        got, counters = load_checkpoint(folder, unverified=True)
    assert counters == {"rounds_done": 1} and np.array_equal(got["w"], state["w"])


def test_resume_refuses_a_state_of_other_dtypes(tmp_path, toy):
    cfg = parse_config(config(toy))
    Simulator(cfg, tmp_path / "run").run()
    state, counters = load_checkpoint(tmp_path / "run" / "checkpoint")
    state["dense1.w"] = state["dense1.w"].astype(np.float64)  # a checkpoint written whole, of another layout
    save_checkpoint(tmp_path / "run" / "checkpoint", state, counters)
    with pytest.raises(CheckpointError, match="'dense1.w' is float64"):
        Simulator(cfg, tmp_path / "run", resume=True).run()


# ------------------------------------------------------------------------------------------- run directories
def test_a_second_run_into_a_locked_folder_is_refused(tmp_path, toy):
    cfg = parse_config(config(toy))
    holder = RunDir(tmp_path / "run")
    holder.lock()
    try:
        with pytest.raises(RunDirLocked, match="another run"):
            Simulator(cfg, tmp_path / "run").run()
        assert not (tmp_path / "run" / "config.toml").exists()  # nothing written
    finally:
        holder.unlock()
    Simulator(cfg, tmp_path / "run").run()  # free again, and the lock is given back at the end
    RunDir(tmp_path / "run").lock()


def test_tampered_run_files_give_clear_errors_on_resume(tmp_path, toy):
    cfg = parse_config(config(toy, 3))
    Simulator(parse_config(config(toy, 2)), tmp_path / "run").run()
    metrics, events = tmp_path / "run" / "metrics.csv", tmp_path / "run" / "events.log"
    good = metrics.read_text()
    metrics.write_text(good.replace("\n1,", "\nx,", 1))
    with pytest.raises(CheckpointError, match="not the metrics a run writes"):
        Simulator(cfg, tmp_path / "run", resume=True).run()
    metrics.write_text(good)
    events.write_text("round 1: fine\nnot an event\n")
    with pytest.raises(CheckpointError, match="line 2 is not an event"):
        Simulator(cfg, tmp_path / "run", resume=True).run()
    events.write_text("round 1: fine\n")
    assert len(Simulator(cfg, tmp_path / "run", resume=True).run()) == 3


def test_a_symbolic_link_where_a_run_file_goes_is_refused(tmp_path, toy):
    out = tmp_path / "run"
    out.mkdir()
    (out / "events.log").symlink_to(tmp_path / "elsewhere.log")
    with pytest.raises(FileExistsError, match="symbolic link"):
        Simulator(parse_config(config(toy)), out).run()
    assert not (tmp_path / "elsewhere.log").exists()


def test_a_full_disk_leaves_the_last_checkpoint_and_no_temporary_file(tmp_path, toy, monkeypatch):
    import os

    cfg = parse_config(config(toy, 3))
    sim = Simulator(cfg, tmp_path / "run")
    real = os.fsync
    calls = {"n": 0}

    def full(fd: int) -> None:
        calls["n"] += 1
        if sim.run_dir.checkpoint_dir.joinpath(STATE_FILE).exists() and calls["n"] > 12:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(RunDirError, match="No space left on device.*intact.*--resume"):
        sim.run()
    monkeypatch.setattr(os, "fsync", real)
    assert not list((tmp_path / "run").rglob("*.tmp"))
    _, counters = load_checkpoint(tmp_path / "run" / "checkpoint")
    assert counters["rounds_done"] >= 1
    assert len(Simulator(cfg, tmp_path / "run", resume=True).run()) == 3


def test_settings_that_cannot_be_right_are_config_errors():
    for key, value in (("train.lr", float("inf")), ("dturbo.beta", float("inf")),
                       ("dturbo.sigma_init_ratio", float("inf")), ("dturbo.sigma_init_ratio", float("nan"))):
        section, name = key.rsplit(".", 1)
        tree: dict = {}
        node = tree
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[name] = value
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            parse_config(tree)
    with pytest.raises(ConfigError, match="experiment.seed"):
        parse_config({"experiment": {"seed": 10**20}})
    with pytest.raises(ConfigError, match="model.hidden.*at most 65536"):
        parse_config({"model": {"hidden": [10**9]}})


def test_an_out_that_cannot_be_written_is_a_clear_error(tmp_path, toy):
    path = tmp_path / "c.toml"
    import tomli_w

    path.write_text(tomli_w.dumps(config(toy)))
    result = CliRunner().invoke(app, ["run", str(path), "--out", "/proc/self", "--no-figures"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "cannot write" in result.output


# ------------------------------------------------------------------------------------------------ Flower
def test_a_partition_id_two_nodes_claim_is_given_to_neither(tmp_path, toy):
    pytest.importorskip("flwr")
    import tomli_w

    from dturbo.flower import client_app
    from dturbo.flower.inprocess import InProcessGrid, run_inprocess

    path = tmp_path / "c.toml"
    path.write_text(tomli_w.dumps(config(toy, 2)))
    grid = InProcessGrid(client_app.app, 3)
    grid._add_node(9_999_991, 1)  # a second node that says it is partition 1
    run_inprocess(path, tmp_path / "flower", grid=grid)
    events = (tmp_path / "flower" / "events.log").read_text().splitlines()
    assert events == [f"round {r}: client 1: did not answer (partition-id=1 is claimed by more than one node "
                      f"({grid.node_id(1)}, 9999991))" for r in (1, 2)]


def test_a_model_too_big_for_memory_is_a_config_error_with_its_size(toy, monkeypatch):
    """hidden = [65536, 65536]: its parameters are counted on the meta device, nothing is allocated, and the error
    gives the memory the run would need and the memory there is."""
    from dturbo.nn import models

    monkeypatch.setattr(models, "available_memory", lambda: 16 * 2**30)
    cfg = parse_config(config(toy, model={"name": "mlp", "hidden": [65536, 65536]}))
    with pytest.raises(ConfigError, match=r"4,296,146,951 parameters: a run needs about 320\.1 GiB .* 16\.0 GiB"):
        Simulator(cfg, Path("never-written"))
    assert not Path("never-written").exists()


def test_the_later_keys_a_checkpoint_fingerprint_leaves_out_hold_the_values_older_runs_ran_with():
    """checkpoint.LATER_METHOD_KEYS: a run written before such a key resumes with the value it ran with, and only with
    it (global_model: "cut" before "trained" became the default)."""
    from dturbo.checkpoint import LATER_METHOD_KEYS, config_fingerprint, with_earlier_values

    for (section, key), value in LATER_METHOD_KEYS.items():
        *outer, inner = section.split(".")
        tree: dict = {inner: {key: value}}
        for name in reversed(outer):
            tree = {name: tree}
        cfg = parse_config(tree).to_dict()
        older = copy.deepcopy(cfg)
        part = older
        for name in section.split("."):
            part = part[name]
        del part[key]
        assert config_fingerprint(older) == config_fingerprint(cfg), (section, key)
        assert with_earlier_values(older) == cfg, (section, key)  # what harness.run_tree reads an older run as
    robust = parse_config({"robust": {"rule": "centered_clip", "min_cosine": 0.0}}).to_dict()  # before cosine_to
    older = {**robust, "robust": {k: v for k, v in robust["robust"].items() if k != "cosine_to"}}
    assert robust["robust"]["cosine_to"] == "median" and config_fingerprint(older) == config_fingerprint(robust)
    robust["robust"]["cosine_to"] = "mean"
    assert config_fingerprint(older) != config_fingerprint(robust)
    robust = parse_config({"robust": {"rule": "krum", "refuse_median": 10.0}}).to_dict()  # before refuse_short
    older = {**robust, "robust": {k: v for k, v in robust["robust"].items() if k != "refuse_short"}}
    assert config_fingerprint(older) == config_fingerprint(robust)
    robust["robust"]["refuse_short"] = 0.5
    assert config_fingerprint(older) != config_fingerprint(robust)
    older = {**robust, "robust": {k: v for k, v in robust["robust"].items() if k != "refuse_close"}}  # before it
    assert config_fingerprint(older) == config_fingerprint(robust)
    robust["robust"]["refuse_close"] = 0.1
    assert config_fingerprint(older) != config_fingerprint(robust)
    assert parse_config({}).dturbo.global_model == "trained"
    cfg = parse_config({}).to_dict()
    older = {**cfg, "dturbo": {k: v for k, v in cfg["dturbo"].items() if k != "global_model"}}
    assert config_fingerprint(older) != config_fingerprint(cfg)
    cfg["dturbo"]["sparsity"]["cost_power"] = 0.5  # a run that set cost_power keeps it in its fingerprint
    older = copy.deepcopy(cfg)
    del older["dturbo"]["sparsity"]["cost_power"]
    assert config_fingerprint(older) != config_fingerprint(cfg)

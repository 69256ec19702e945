"""``environment.jsonl`` (docs/rundir.md): each session that trains a run names what its numbers depend on besides
the config and seed, so a run that does not reproduce on another machine says why it may not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from run_helpers import cut_and_resume
from test_positions_delta import config

import dturbo
from dturbo.device import machine
from dturbo.rundir import RunDir


@pytest.fixture(scope="module")
def toy(make_toy) -> Path:
    return make_toy(300)


def sessions(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "environment.jsonl").read_text().splitlines()]


def test_each_session_of_a_run_names_its_machine(tmp_path, toy):
    """An uninterrupted run has one session from round 0; one cut after round 2 and resumed has a second from round
    2; each names this dturbo, python's torch and numpy, and the vector instructions torch's kernels use."""
    cut_and_resume(config(toy, "delta", 4), tmp_path / "whole", tmp_path / "part", cut=2)
    whole, part = sessions(tmp_path / "whole"), sessions(tmp_path / "part")
    assert [s["first_round"] for s in whole] == [0] and [s["first_round"] for s in part] == [0, 2]
    for s in whole + part:
        assert (s["dturbo"], s["torch"], s["numpy"]) == (dturbo.__version__, torch.__version__, np.__version__)
        assert s["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and s["device"] == "cpu"
        assert s["cpu"] and s["threads"] == 1


def test_a_session_trained_again_replaces_the_lines_of_the_rounds_it_repeats(tmp_path):
    """Resuming from round 2 drops the sessions that began at round 2 or later (their rounds are trained again) and
    keeps the earlier ones and any line that is not a session's record."""
    run = RunDir(tmp_path)
    first = machine() | {"first_round": 0}
    (tmp_path / "environment.jsonl").write_text(
        "\n".join([json.dumps(first), json.dumps({"first_round": 2}), "not json", json.dumps({"first_round": 5})])
        + "\n")
    run.record_environment(2, {"cpu": "elsewhere"})
    lines = (tmp_path / "environment.jsonl").read_text().splitlines()
    assert lines[1] == "not json"
    assert [json.loads(line) for line in (lines[0], lines[2])] == [first, {"first_round": 2, "cpu": "elsewhere"}]


def test_an_environment_path_that_cannot_be_written_is_a_clear_error(tmp_path):
    from dturbo.rundir import RunDirError

    (tmp_path / "environment.jsonl").mkdir()  # a folder where the file goes
    with pytest.raises(RunDirError, match="cannot write .*environment.jsonl"):
        RunDir(tmp_path).record_environment(0, machine())

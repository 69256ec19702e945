"""A small harness for benchmark campaigns: a protocol and its candidates as data, one job per (candidate, seed),
finished runs cached by their resolved config, a scheduler, and the runs read back.

A campaign file (TOML) holds ``[protocol]`` (``config``: the config tree every run starts from; ``seeds``), shared
settings as ``[base.NAME]`` tables of dotted config keys, and one ``[[candidate]]`` per setting (``label``,
``method``: the line it competes in, ``algorithm``, ``note``, ``base``: a base's name, optional, ``set``: dotted
config keys applied after it). Each run's ``metrics.csv`` and ``config.toml`` are copied to
``<results>/<tag>_runs/<label>_s<seed>.{csv,toml}`` (committed), so a report needs no run directory. A job whose
resolved config equals a committed run's (of this campaign or of any other under ``<results>/*_runs/``) reuses that
run: training is a pure function of its config, which :func:`verify` checks on the first rounds.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dturbo.algorithms.registry import ALGORITHMS  # noqa: E402
from dturbo.checkpoint import with_earlier_values  # noqa: E402
from dturbo.config import Config, ConfigError  # noqa: E402
from dturbo.device import machine  # noqa: E402
from dturbo.rundir import RunDir, RunDirLocked  # noqa: E402
from dturbo.settings import parse_config  # noqa: E402

# Keys that name or locate a run without changing what it computes: left out of the cache key.
NEUTRAL_KEYS = (("experiment", "name"), ("data", "path"))
# Config sections only one algorithm reads (each registered method's own): a run is compared without the others'.
METHOD_SECTIONS = tuple(ALGORITHMS)
DEFAULT_DATA = {"fashion-mnist": "/usr/share/datasets/fashion-mnist", "mnist": "/usr/share/datasets/mnist"}


def dataset_path(name: str = "fashion-mnist", given: str | None = None) -> str:
    """Where dataset ``name`` is read from: ``given``, else $DTURBO_DATA, else the Debian package's folder."""
    return given or os.environ.get("DTURBO_DATA") or DEFAULT_DATA.get(name, "")


# The settings the sweeps' and the fault run's recorded results were trained with, where the library's defaults
# differ (the paper's float16 messages, sigma a tenth of the layer's weight scale): overrides that reproduce them.
RECORDED = ["dturbo.transmission.up_bits=16", "dturbo.transmission.down_bits=16",
            'dturbo.transmission.prior_std="sent"', 'dturbo.transmission.positions="full"',
            'dturbo.transmission.values_code="fixed"', 'dturbo.prior_std_dtype="float16"',
            "dturbo.sigma_init_ratio=0.1"]


class HarnessError(RuntimeError):
    """A campaign file or a cached run that cannot be used."""


# ------------------------------------------------------------------------------------------ campaign data
@dataclass(frozen=True)
class Candidate:
    """One setting: ``label`` unique, ``method`` the line it competes in, ``overrides`` dotted config keys."""

    label: str
    method: str
    algorithm: str
    overrides: dict[str, Any]
    note: str


@dataclass(frozen=True)
class Campaign:
    """A protocol and its candidates, read from a TOML file."""

    tag: str
    protocol: dict[str, Any]
    candidates: list[Candidate]

    @property
    def seeds(self) -> list[int]:
        return list(self.protocol["seeds"])

    @property
    def base(self) -> dict[str, Any]:
        return self.protocol["config"]

    def by_label(self) -> dict[str, Candidate]:
        return {c.label: c for c in self.candidates}

    def methods(self) -> list[str]:
        return list(dict.fromkeys(c.method for c in self.candidates))


def load_campaign(path: Path) -> Campaign:
    """The campaign of a TOML file; HarnessError naming what is wrong (a repeated label, a key no config has)."""
    data = tomllib.loads(path.read_text())
    try:
        protocol = data["protocol"]
        protocol["config"], protocol["seeds"]
        bases = data.get("base", {})
        cands = [Candidate(c["label"], c["method"], c["algorithm"], {**bases[c["base"]], **c.get("set", {})}
                           if "base" in c else dict(c.get("set", {})), c["note"]) for c in data["candidate"]]
    except KeyError as err:
        raise HarnessError(f"{path}: missing {err}") from None
    labels = [c.label for c in cands]
    if len(set(labels)) != len(labels):
        raise HarnessError(f"{path}: repeated labels {sorted({x for x in labels if labels.count(x) > 1})}")
    camp = Campaign(path.stem, protocol, cands)
    for c in cands:  # every candidate must make a valid config and algorithm: found now, not hours into a campaign
        try:
            preflight(parse_config(config_tree(camp, c, camp.seeds[0])))
        except (ConfigError, ValueError) as err:
            raise HarnessError(f"{path}: candidate {c.label!r}: {err}") from None
    return camp


# Samples of the datasets a campaign may name: (input shape, classes), to build a run's algorithm without its data.
SHAPES = {"fashion-mnist": ((1, 28, 28), 10), "mnist": ((1, 28, 28), 10), "cifar10": ((3, 32, 32), 10),
          "cifar100": ((3, 32, 32), 100)}


def preflight(cfg: Config) -> None:
    """Build the run's server on its model (what a run checks before its first round: layer targets, the
    method's own settings), without reading its data; ConfigError / ValueError naming the problem."""
    from dturbo.algorithms.registry import ALGORITHMS, model_factory

    if cfg.data.name not in SHAPES:
        return
    shape, classes = SHAPES[cfg.data.name]
    with torch.random.fork_rng(devices=[]):
        ALGORITHMS[cfg.experiment.algorithm].server(cfg, model_factory(cfg, shape, classes), 1000)


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def config_tree(camp: Campaign, cand: Candidate, seed: int, data_path: str | None = None) -> dict[str, Any]:
    """The config of one run: the protocol's, then the candidate's overrides, its name, seed and algorithm."""
    tree = copy.deepcopy(camp.base)
    tree.setdefault("experiment", {}).update(name=f"{camp.tag}_{cand.label}_s{seed}", seed=seed,
                                             algorithm=cand.algorithm)
    data = tree.setdefault("data", {})
    if data_path is not None or "path" not in data:
        data["path"] = dataset_path(data.get("name", ""), data_path)
    for key, value in cand.overrides.items():
        _set(tree, key, value)
    return tree


def cache_key(tree: dict[str, Any]) -> dict[str, Any]:
    """What a run computes: the resolved config (defaults filled in) less its name, its data's location and the
    sections of the methods it does not run."""
    resolved = parse_config(tree).to_dict()
    algorithm = resolved["experiment"]["algorithm"]
    out = {k: v for k, v in resolved.items() if k not in METHOD_SECTIONS or k == algorithm}
    for section, key in NEUTRAL_KEYS:
        out.get(section, {}).pop(key, None)
    return out


def run_tree(path: Path) -> dict[str, Any]:
    """A run's config.toml as it ran: a key the file predates read as the value the run ran with (a default that
    changed since), as ``dturbo`` reads a run directory."""
    return with_earlier_values(tomllib.loads(path.read_text()))


def _toml_key(path: Path) -> dict[str, Any] | None:
    try:
        return cache_key(run_tree(path))
    except (OSError, tomllib.TOMLDecodeError, ConfigError, KeyError):
        return None


def csv_rows(path: Path) -> int:
    try:
        return max(0, len(path.read_text().strip().splitlines()) - 1)
    except OSError:
        return 0


# ------------------------------------------------------------------------------------------------- jobs
@dataclass
class Settings:
    """Where one invocation reads and writes."""

    results: Path = ROOT / "benchmarks" / "results"
    runs_root: Path = ROOT / "runs"
    data_path: str | None = None


@dataclass
class Job:
    camp: Campaign
    cand: Candidate
    seed: int
    s: Settings
    # done (committed) / reuse (a committed run of the same config elsewhere) / copy (complete run directory) /
    # resume / todo / conflict (its run directory holds another config)
    status: str = "todo"
    rounds_left: int = 0
    source: Path | None = None

    @property
    def name(self) -> str:
        return f"{self.cand.label}_s{self.seed}"

    @cached_property
    def tree(self) -> dict[str, Any]:
        return config_tree(self.camp, self.cand, self.seed, self.s.data_path)

    @cached_property
    def key(self) -> dict[str, Any]:
        return cache_key(self.tree)

    @property
    def rounds(self) -> int:
        return int(self.key["experiment"]["rounds"])

    @property
    def committed(self) -> Path:
        return self.s.results / f"{self.camp.tag}_runs"

    @property
    def run_dir(self) -> Path:
        return self.s.runs_root / self.camp.tag / self.name


class RunIndex:
    """Every committed run under ``<results>/*_runs/`` by cache key (for reuse across campaigns)."""

    def __init__(self, results: Path) -> None:
        self.entries: list[tuple[dict[str, Any], Path]] = []
        for toml_path in sorted(results.glob("*_runs/*.toml")):
            key = _toml_key(toml_path)
            if key is not None:
                self.entries.append((key, toml_path.with_suffix(".csv")))

    def find(self, key: dict[str, Any], rounds: int) -> Path | None:
        return next((p for k, p in self.entries if k == key and csv_rows(p) >= rounds), None)


def plan(job: Job, index: RunIndex | None = None) -> Job:
    """Set what is left to do for ``job``."""
    csv_path, toml_path = job.committed / f"{job.name}.csv", job.committed / f"{job.name}.toml"
    if csv_rows(csv_path) >= job.rounds and _toml_key(toml_path) == job.key:
        job.status = "done"
        return job
    have = _toml_key(job.run_dir / "config.toml")
    if have is not None and have != job.key:
        job.status = "conflict"  # never resumed nor overwritten: the user decides
        return job
    done = csv_rows(job.run_dir / "metrics.csv")
    if have is not None and done >= job.rounds and (job.run_dir / "model.safetensors").exists():
        job.status = "copy"
    elif have is not None and (job.run_dir / "checkpoint").exists():
        job.status, job.rounds_left = "resume", job.rounds - done
    elif index is not None and (src := index.find(job.key, job.rounds)) is not None:
        job.status, job.source = "reuse", src
    else:
        job.status, job.rounds_left = "todo", job.rounds
    return job


_lock = threading.Lock()


def write_results(results: Path, stem: str, res: dict[str, Any], markdown: str) -> None:
    """``<results>/<stem>.json`` and ``.md``, and the markdown printed."""
    results.mkdir(exist_ok=True)
    (results / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    (results / f"{stem}.md").write_text(markdown)
    print(markdown)


def source_digest(setting: dict[str, Any]) -> str:
    """10 hex digits of ``setting`` and dturbo's code and presets: the run folder of a run made with them, so that a
    finished run of another setting, other code or other presets is not taken for this one's."""
    import hashlib

    digest = hashlib.sha256(json.dumps(setting, sort_keys=True).encode())
    for path in sorted(p for p in (ROOT / "src" / "dturbo").rglob("*") if p.suffix in (".py", ".toml")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def say(msg: str) -> None:
    with _lock:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _env() -> dict[str, str]:
    # One torch thread per run (experiment.threads = 1 too): float sums depend on the thread count, and two runs
    # share 2 cores without oversubscription.
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def execute(job: Job) -> bool:
    """Run, resume, copy or reuse one job; the committed copy is written last (a cut run leaves none)."""
    job.committed.mkdir(parents=True, exist_ok=True)
    # (f-strings, not with_suffix, which would cut a label at its first dot)
    csv_dest, toml_dest = job.committed / f"{job.name}.csv", job.committed / f"{job.name}.toml"
    if job.status == "reuse":
        assert job.source is not None
        shutil.copyfile(job.source, csv_dest)
        shutil.copyfile(job.source.with_suffix(".toml"), toml_dest)
        if (env := environment_of(job.source)).exists():
            shutil.copyfile(env, environment_of(csv_dest))
        say(f"{job.name}: reused {job.source.parent.name}/{job.source.name} (the same resolved config)")
        return True
    if job.status in ("todo", "resume"):
        plan(job)  # again: another campaign process may have finished or started it since the plan
        if job.status == "conflict":
            say(f"{job.name}: skipped: {job.run_dir} holds a run of another config")
            return False
        if job.status in ("copy", "done"):
            say(f"{job.name}: finished by another process")
    if job.status in ("todo", "resume"):
        if job.status == "todo" and job.run_dir.exists():
            try:  # another campaign process may be running it: its lock says so, and the folder stays
                held = RunDir(job.run_dir)
                held.lock()
                held.unlock()
            except RunDirLocked as err:
                say(f"{job.name}: skipped: {err}")
                return False
            shutil.rmtree(job.run_dir)  # a run cut before its first checkpoint
        cfg_path = job.s.runs_root / job.camp.tag / "_configs" / f"{job.name}.toml"
        cfg_path.parent.mkdir(parents=True, exist_ok=True)
        cfg_path.write_text(parse_config(job.tree).to_toml())
        cmd = [sys.executable, "-m", "dturbo", "run", str(cfg_path), "--out", str(job.run_dir), "--no-figures"]
        if job.status == "resume":
            cmd.append("--resume")
        log = job.run_dir.parent / f"{job.name}.log"
        say(f"{job.name}: {job.status}, {job.rounds_left} rounds (log {log})")
        t0 = time.perf_counter()
        with open(log, "a") as f:
            rc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            tail = "\n    ".join(log.read_text().strip().splitlines()[-6:])
            say(f"{job.name}: FAILED (exit {rc}):\n    {tail}")
            return False
        say(f"{job.name}: finished in {(time.perf_counter() - t0) / 60:.1f} min")
    if job.status != "done":
        if (job.run_dir / "environment.jsonl").exists():
            shutil.copyfile(job.run_dir / "environment.jsonl", environment_of(csv_dest))
        shutil.copyfile(job.run_dir / "metrics.csv", csv_dest)
        shutil.copyfile(job.run_dir / "config.toml", toml_dest)
    return True


def environment_of(csv_path: Path) -> Path:
    """The committed copy of a run's environment.jsonl (the machine of each session that trained it), beside its
    metrics: ``<name>.environment.jsonl``; runs committed before it was written have none."""
    return csv_path.with_name(csv_path.name.removesuffix(".csv") + ".environment.jsonl")


def sessions_of(csv_path: Path) -> list[dict[str, Any]]:
    """The machine of each session that trained a committed run (:func:`environment_of`), first first; none for a
    run committed before they were recorded."""
    env = environment_of(csv_path)
    return [json.loads(line) for line in env.read_text().splitlines() if line.strip()] if env.exists() else []


def run_jobs(jobs: list[Job], n: int) -> list[Job]:
    """Everything left, ``n`` at a time in the given order; returns the jobs that failed."""
    clash = [j for j in jobs if j.status == "conflict"]
    if clash:
        raise HarnessError("run directories of another config than the one wanted: remove or move them, then run "
                           "again: " + ", ".join(str(j.run_dir) for j in clash))
    with ThreadPoolExecutor(max_workers=max(1, n)) as pool:
        ok = list(pool.map(execute, jobs))
    return [j for j, good in zip(jobs, ok, strict=True) if not good]


def print_plan(title: str, jobs: list[Job]) -> None:
    left = [j for j in jobs if j.status in ("todo", "resume")]
    print(f"== {title}: {len(jobs)} runs, {len(left)} to train")
    for j in jobs:
        extra = f" ({j.rounds_left} rounds)" if j in left else ""
        src = f" from {j.source.parent.name}/{j.source.name}" if j.source is not None else ""
        print(f"  {j.name:44s} {j.cand.algorithm:7s} {j.status}{extra}{src}")


# ---------------------------------------------------------------------------------------- reading runs
def metrics_rows(out: Path) -> list[dict[str, str]]:
    """A run directory's metrics.csv as its rows of text (none when it holds none yet)."""
    path = out / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def fill_block(doc: Path, name: str, text: str) -> None:
    """Put ``text`` between ``<!-- generated: name -->`` and ``<!-- end generated -->`` in ``doc``."""
    old = doc.read_text()
    begin, end = f"<!-- generated: {name} -->\n", "<!-- end generated -->"
    i = old.index(begin) + len(begin)
    doc.write_text(old[:i] + text + old[old.index(end, i):])


def read_csv(path: Path) -> dict[str, np.ndarray]:
    """A metrics.csv as float columns (empty cells NaN)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([float(r[k]) if r[k] != "" else np.nan for r in rows]) for k in (rows[0] if rows else [])}


@dataclass
class Run:
    """One finished run as committed: its candidate, seed, config and metrics columns."""

    cand: Candidate
    seed: int
    cfg: Config
    m: dict[str, np.ndarray]
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def final_acc(self) -> float:
        return float(self.m["accuracy"][-1])

    @property
    def final_val(self) -> float:
        return float(self.m["val_accuracy"][-1])

    @property
    def density(self) -> float:
        return float(self.m["density"][-1])

    @property
    def total_bits(self) -> float:
        return float(self.m["cum_bits"][-1])

    def bits_to(self, target: float, column: str = "accuracy") -> float | None:
        """Cumulative bits (up + down) at the first round whose ``column`` reaches ``target``; None if never."""
        return bits_to(self.m["cum_bits"], self.m[column], target)

    def curve(self) -> list[list[float]]:
        """[[round, cumulative bits, test accuracy], ...]."""
        return [[int(r), float(b), float(a)] for r, b, a in zip(self.m["round"], self.m["cum_bits"],
                                                                 self.m["accuracy"], strict=True)]


def bits_to(cum_bits: np.ndarray, acc: np.ndarray, target: float) -> float | None:
    """The cumulative bits of the first round whose accuracy is at least ``target`` (None: never)."""
    hit = np.flatnonzero(np.nan_to_num(np.asarray(acc, dtype=float), nan=-1.0) >= target - 1e-12)
    return float(np.asarray(cum_bits)[hit[0]]) if hit.size else None


def load_runs(camp: Campaign, s: Settings) -> list[Run]:
    """Every complete committed run of a candidate of ``camp``."""
    by_label = camp.by_label()
    out = []
    for csv_path in sorted((s.results / f"{camp.tag}_runs").glob("*_s*.csv")):
        label, _, seed = csv_path.stem.rpartition("_s")
        if label not in by_label or not seed.isdigit() or not csv_path.with_suffix(".toml").exists():
            continue
        cfg = parse_config(run_tree(csv_path.with_suffix(".toml")))
        m = read_csv(csv_path)
        if m and len(m["round"]) >= cfg.experiment.rounds:
            out.append(Run(by_label[label], int(seed), cfg, m))
    return out


# ------------------------------------------------------------------------------------------ verification
class _Stop(Exception):
    pass


def run_name(csv_path: Path) -> str:
    """The ``experiment.name`` a committed run was trained under."""
    return str(tomllib.loads(csv_path.with_suffix(".toml").read_text())["experiment"]["name"])


def trained_elsewhere(csv_path: Path, tag: str) -> bool:
    """Whether a committed run was trained by another campaign than ``tag`` (its config names it)."""
    return not run_name(csv_path).startswith(f"{tag}_")


def verify(job: Job, csv_path: Path, rounds: int = 2,
           columns: tuple[str, ...] = ("accuracy", "loss", "val_accuracy", "density", "up_bits", "down_bits",
                                       "cum_bits")) -> list[str]:
    """Train the first ``rounds`` rounds of ``job``'s config with the code here and compare them with the committed
    run ``csv_path``, column by column; returns the differences (none: the cache holds what this code computes)."""
    import tempfile

    from dturbo.sim import Simulator

    committed = read_csv(csv_path)
    cfg = parse_config(job.tree)
    with tempfile.TemporaryDirectory() as tmp:
        def stop(row: dict[str, Any]) -> None:
            if int(row["round"]) >= rounds:
                raise _Stop

        try:
            Simulator(cfg, Path(tmp) / "run", on_round=stop).run()
        except _Stop:
            pass
        fresh = read_csv(Path(tmp) / "run" / "metrics.csv")
    diffs = []
    for col in columns:
        if col not in committed and col not in fresh:  # e.g. no validation split
            continue
        if (col in committed) != (col in fresh):
            diffs.append(f"{col}: in {'the committed run' if col in committed else 'this code'}'s metrics only")
            continue
        a, b = committed[col][:rounds], fresh[col][:rounds]
        if not np.array_equal(a, b):
            diffs.append(f"{col}: committed {a.tolist()} vs now {b.tolist()}")
    if diffs:  # the same code rounds differently on a CPU with other vector instructions
        here = machine()
        there = next(iter(sessions_of(csv_path)), None)
        diffs.append(f"verified on {here['cpu']} ({here['cpu_capability']}, torch {here['torch']}); trained on "
                     + (f"{there.get('cpu')} ({there.get('cpu_capability')}, torch {there.get('torch')})" if there
                        else "a machine its files do not name"))
    return diffs

"""Attacks that stay inside the bounds, against every method's recommended robust rule, in the simulator and through
the Flower Strategy: runs that must not stop, resumes that must work, accuracy that must hold, memory that must stay
bounded.

    python benchmarks/attacks_inside.py [--rounds 12] [--jobs 2] [--seeds 0 1 2] [--work runs/attacks_inside]
        [--stage runs|main|report|candidates|screen|second|third|fourth|absent] [--reuse METHOD ...]

A stage run at another length than the matrix's 12 rounds writes its results beside the matrix's: NAME_N.{json,md}.

Fashion-MNIST (3000 training images, 1000 test), 10 clients (Dirichlet 0.5), 2 local epochs, one torch thread a run,
each row on the seeds given (its accuracy and its clean run's the means over them), every method with its preset's
settings and its recommended rule (``RECOMMENDED``, fixed before the runs). Two models: ``mlp`` (the built-in 200-100
mlp) and ``bn`` (the same with BatchNorm after each hidden layer, a model of one's own, its statistics calibrated).
Two runners: ``simulator`` (``dturbo.sim.Simulator``: the run is stopped after half its rounds, as a crash after a
checkpoint, and resumed) and ``strategy`` (``dturbo.flower``'s Strategy on an in-process Flower grid, the attackers'
replies rewritten on their way to the server; a Strategy keeps no checkpoint, so it has no resume to try).

Attacks (``dturbo.attacks``): on ``mlp`` the scaled sign flip, ALIE and IPM; on ``bn`` the poisoned state outside
the Bayesian layers and poisoned calibration statistics; each with 1 and with 3 attackers; and on ``mlp`` one reply
of 200 MB (refused: its peak memory against the honest run's). Every run is one fresh process (its peak RSS is its
own).

Goals: no run stops; every resume works; final accuracy within 2 points of the clean run with 1 attacker
and 4 with 3; peak memory at most 2x the clean run's. ``--reuse METHOD`` reads the runs of METHOD's rows from the
committed attacks.json instead of running them, where that file's rule for METHOD is today's (for a rerun of the
other methods' rows alone). Writes benchmarks/results/attacks.{json,md}: ``runs`` holds
one row per runner x model x method x attack x attackers with exactly the keys of ``ROW``; ``details`` the same rows'
other figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import dataset_path, fill_block, metrics_rows, source_digest  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PRESETS = {"dturbo": "quick", "fedavg": "fedavg", "fedpaq": "fedpaq", "dssm": "dssm", "stc": "stc", "fedpm": "fedpm",
           "feddst": "feddst"}
# The rules: the updates clipped to the round's median norm, then a trimmed mean that trims at least 3 at each end,
# Krum keeping 7 of 10, or centered clipping.
TRIMMED = {"robust.rule": "trimmed_mean", "robust.trim": 0.1, "robust.byzantine": 3, "robust.clip_median": 1.0}
KRUM = {"robust.rule": "krum", "robust.byzantine": 3, "robust.clip_median": 1.0}
# Candidates for the rule against 3 attackers of 10, fixed before their runs and chosen on the validation split
# (--stage candidates: every method, both models, clean and under each model's attacks, 3 attackers): each method
# takes its candidate of highest mean validation accuracy. Centered clipping clips distances, not coordinates, so it
# suits the sparse and quantised updates too.
CENTERED = {"robust.rule": "centered_clip", "robust.radius": 1.0, "robust.clip_median": 1.0}
CANDIDATES = {"trim3_clip1": TRIMMED, "trim3_clip05": TRIMMED | {"robust.clip_median": 0.5},
              "krum3_clip1": KRUM, "cc1_clip1": CENTERED, "cc05_clip1": CENTERED | {"robust.radius": 0.5}}
CANDIDATE_METHODS = ("dturbo", "fedavg", "fedpaq", "dssm", "stc", "fedpm", "feddst")
CANDIDATE_RUNS = (("mlp", "none", 0), ("mlp", "scaled_sign_flip", 3), ("mlp", "ipm", 3), ("mlp", "alie", 3),
                  ("bn", "none", 0), ("bn", "plain_state", 3), ("bn", "calibration", 3))
# Each method's recommended rule: its candidate of highest mean validation accuracy (robust_candidates.md).
# DSSM's rounds shrink to dssm.min_clients uploads; it is raised to 2 f + 1 = 7 for f = 3 attackers, derived rather
# than chosen: a round of fewer may hold as many hostile uploads as honest ones, which no rule tells apart.
RULES = {"dturbo": CENTERED, "fedavg": CENTERED, "fedpaq": KRUM,
         "dssm": CANDIDATES["cc05_clip1"] | {"dssm.min_clients": 7}, "stc": CENTERED, "fedpm": KRUM, "feddst": CENTERED}
# Then, per method, its rule alone, with the uploads that point away from the round's median update left out first
# (robust.min_cosine = 0), and with those whose update norm is above 10 times the round's median left out as well
# (robust.refuse_median = 10: an order of magnitude beyond the honest uploads' spread, fixed before the runs), on the
# same validation runs (--stage screen, robust_screen.md): each method takes the one of highest mean validation
# accuracy, the simpler on a tie.
SCREENS = {"rule": {}, "rule_screen": {"robust.min_cosine": 0.0},
           "rule_screen_refuse": {"robust.min_cosine": 0.0, "robust.refuse_median": 10.0}}
SCREENED = {"dturbo": "rule_screen_refuse", "fedavg": "rule_screen_refuse", "fedpaq": "rule_screen_refuse",
            "dssm": "rule_screen_refuse", "stc": "rule_screen_refuse", "fedpm": "rule", "feddst": "rule_screen_refuse"}
FIRST = {m: r | SCREENS[SCREENED[m]] for m, r in RULES.items()}
# A second round (--stage second, robust_second.md), fixed before its runs, on the same seven validation runs: each
# method's rule of the first round against its candidates here. A sparse update (STC's ternary one) has a
# coordinate-wise median of 0 nearly everywhere, so the candidates' cosine screen compares each update with the mean
# of the other updates (clipped as the rule clips), refusing what points away from it (0) or what follows it less
# than honest updates do (0.3); FedPAQ's candidates start from centered clipping, since the screens stop the sign
# flip it lost to under centered clipping in the first round, while the identical uploads of colluding ALIE attackers
# are what Krum selects; FedPM's masks are screened by their likelihood under theta_G whenever a rule is set, so its
# candidate is the plain mean of the masks that pass (Krum also drops honest masks).
# Each method takes its candidate of highest mean validation accuracy; a tie keeps the earlier. A candidate that beats
# the first round's rule on seed 0 meets it again over seeds 0-2 (the higher mean wins; a tie keeps the first's).
MEAN_SCREEN = {"robust.min_cosine": 0.0, "robust.cosine_to": "mean", "robust.refuse_median": 10.0}
SECOND = {m: {"mean_masks": {"robust.rule": "mean", "robust.refuse_median": 10.0}} if m == "fedpm" else
          {"rule_mean": (CENTERED if m == "fedpaq" else r) | MEAN_SCREEN,
           "rule_mean03": (CENTERED if m == "fedpaq" else r) | MEAN_SCREEN | {"robust.min_cosine": 0.3}}
          for m, r in RULES.items()}
# A third round (--stage third, robust_third.md), fixed before its runs, the same way: each method's rule after the
# second round against it with a floor on update norms (robust.refuse_short), refusing what is shorter than 0.5 or
# 0.3 times the round's median update. ALIE's and IPM's uploads are built from the honest mean, which is shorter than
# an honest update where honest updates disagree (STC's ALIE uploads: 0.14-0.22 of the median norm in seed 0's first
# rounds). FedPM's masks have no update norm: no candidate.
FLOORS = {"floor05": 0.5, "floor03": 0.3}


def _chosen(name: str) -> dict[str, str]:
    """Each method's choice as a round's results file has it (before that round ran: none)."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text())["chosen"] if path.exists() else {}


SECOND_CHOSEN = {m: "first" for m in FIRST} | _chosen("robust_second")
AFTER_SECOND = {m: r if SECOND_CHOSEN[m] == "first" else SECOND[m][SECOND_CHOSEN[m]] for m, r in FIRST.items()}
THIRD = {m: {} if m == "fedpm" else {c: r | {"robust.refuse_short": f} for c, f in FLOORS.items()}
         for m, r in AFTER_SECOND.items()}
THIRD_CHOSEN = {m: SECOND_CHOSEN[m] for m in FIRST} | _chosen("robust_third")
AFTER_THIRD = {m: THIRD[m].get(THIRD_CHOSEN[m], r) for m, r in AFTER_SECOND.items()}
# A fourth round (--stage fourth, robust_fourth.md), fixed before its runs, the same way, for FedPAQ, the one method
# whose ALIE row misses the goal after the third: its rule against the same rule refusing every upload within 0.1
# times the round's median distance between updates of another (robust.refuse_close). Colluding ALIE attackers send
# one vector: FedPAQ's three land at distance 0 from each other in seed 0's first rounds, where each honest upload's
# nearest other is 0.65-1.2 times the median distance, and Krum selects the three.
CLOSE = {"close01": 0.1}
FOURTH = {m: {c: r | {"robust.refuse_close": v} for c, v in CLOSE.items()} if m == "fedpaq" else {}
          for m, r in AFTER_THIRD.items()}
FOURTH_CHOSEN = dict(THIRD_CHOSEN) | _chosen("robust_fourth")
RECOMMENDED = {m: FOURTH[m].get(FOURTH_CHOSEN[m], r) for m, r in AFTER_THIRD.items()}
ATTACKS = {"mlp": ("scaled_sign_flip", "alie", "ipm"), "bn": ("plain_state", "calibration")}
OVERSIZE = "upload_200MB"
ATTACKERS = (1, 3)
RUNNERS = ("simulator", "strategy")
GOAL = {"points": {1: 2.0, 3: 4.0}, "memory_ratio": 2.0}
# where a row was run (a row may name another machine: the benchmark's runs are portable, one process each)
HERE_MACHINE = f"{platform.platform()}, Python {platform.python_version()}"
SCHEMA_RUNNER = {"simulator": "sim", "strategy": "strategy"}  # the runner's name in attacks.json's rows
ROW = ("runner", "model", "method", "attack", "attackers", "robust", "rule", "stopped", "resume_ok", "accuracy",
       "clean_accuracy", "peak_rss_mb", "clean_peak_rss_mb")


def rule_name(method: str) -> str:
    r = RECOMMENDED[method]
    keys = ("byzantine", "trim", "radius", "clip_median", "min_cosine", "cosine_to", "refuse_median",
            "refuse_short", "refuse_close")
    head = ", ".join(f"{k} {r['robust.' + k]}" for k in keys if "robust." + k in r)
    return f"{r['robust.rule']} {head}" + "".join(f", {k} {v}" for k, v in r.items() if not k.startswith("robust."))


def jobs(rounds: int, seeds: tuple[int, ...] = (0,)) -> list[dict[str, Any]]:
    """Every run of the matrix, on each seed: the clean ones first (each attack's row compares against its clean
    run)."""
    out = []
    for runner in RUNNERS:
        methods = list(PRESETS) if runner == "simulator" else strategy_methods()
        for model, attacks in ATTACKS.items():
            for method in methods:
                out.append({"runner": runner, "model": model, "method": method, "attack": "none", "attackers": 0})
                if model == "mlp":
                    out.append({"runner": runner, "model": model, "method": method, "attack": OVERSIZE,
                                "attackers": 1})
                out += [{"runner": runner, "model": model, "method": method, "attack": a, "attackers": k}
                        for a in attacks for k in ATTACKERS]
                if runner == "simulator":  # the recommended rule's cost without attackers, against the plain mean
                    out.append({"runner": runner, "model": model, "method": method, "attack": "none",
                                "attackers": 0, "candidate": "mean"})
    for j in out:
        j["rounds"] = rounds
    return [j | ({"seed": seed} if seed else {}) for seed in seeds for j in out]


def strategy_methods() -> list[str]:
    """The methods the Flower Strategy runs (none where Flower is not installed)."""
    try:
        from dturbo.flower.protocol import algorithms
    except ModuleNotFoundError:
        return []
    return [m for m in PRESETS if m in algorithms()]


def key(job: dict[str, Any]) -> str:
    """The row a run belongs to (runner/model/method/attack/attackers[/candidate]), then its seed when not 0."""
    return (f"{job['runner']}/{job['model']}/{job['method']}/{job['attack']}/{job['attackers']}"
            + (f"/{job['candidate']}" if "candidate" in job else "") + (f"/s{job['seed']}" if job.get("seed") else ""))


def row_key(job: dict[str, Any]) -> str:
    return key({k: v for k, v in job.items() if k != "seed"})


# ------------------------------------------------------------------------------------------------ one run
class MlpBn:
    """The built-in mlp's shape (200, 100) with BatchNorm after each hidden layer: a model of one's own."""

    def __new__(cls) -> Any:
        from torch import nn

        return nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.BatchNorm1d(200), nn.ReLU(), nn.Linear(200, 100),
                             nn.BatchNorm1d(100), nn.ReLU(), nn.Linear(100, 10))


def rule_of(job: dict[str, Any]) -> dict[str, Any]:
    """The settings of a job's rule: a candidate's (--stage candidates), its method's rule with or without the screens
    (--stage screen: :data:`SCREENS`), the plain mean (``mean``), else its method's recommended one."""
    cand = job.get("candidate")
    if cand is None:
        return RECOMMENDED[job["method"]]
    if cand == "mean":
        return {}
    if cand in SCREENS:
        return RULES[job["method"]] | SCREENS[cand]
    if cand == "first":
        return FIRST[job["method"]]
    for later in (SECOND, THIRD, FOURTH):
        if cand in later[job["method"]]:
            return later[job["method"]][cand]
    return CANDIDATES[cand]


def config(job: dict[str, Any]) -> Any:
    from dturbo.settings import load_config

    over: dict[str, Any] = {
        "experiment.rounds": job["rounds"], "experiment.seed": job.get("seed", 0), "experiment.threads": 1,
        "data.path": dataset_path(),
        "data.limit_train": 3000, "data.limit_test": 1000, "train.local_epochs": 2.0,
        "model.name": "mlp" if job["model"] == "mlp" else "custom",
        **rule_of(job)}
    if job.get("candidate", "mean") != "mean":  # a candidate rule: chosen on a validation split held out
        over["data.validation"] = 0.1
    if job["method"] == "dturbo":  # the quick preset's training as the matrix's rows ran it: a constant rate, "cut"
        over |= {"dturbo.sparsity.warmup_rounds": 1, "dturbo.sparsity.ramp_rounds": max(1, job["rounds"] - 4),
                 "train.lr_warmup_rounds": 0, "dturbo.global_model": "cut"}
    if job["attackers"] and job["attack"] != OVERSIZE:
        over |= {"faults.attackers": job["attackers"], "faults.attack": job["attack"]}
    return load_config(preset=PRESETS[job["method"]], overrides=over)


class Stop(Exception):
    """Raised after a round is recorded: the run stops there, as a crash after its checkpoint."""


def oversize(upload: bytes) -> bytes:
    return upload + bytes(200 << 20)


def run_simulator(job: dict[str, Any], cfg: Any, dataset: Any, out: Path) -> dict[str, Any]:
    import shutil

    from dturbo.attacks import hostile_clients
    from dturbo.nn.convert import user_model_factory
    from dturbo.sim import Simulator

    shutil.rmtree(out, ignore_errors=True)
    factory = None
    if job["model"] == "bn":
        d = cfg.dturbo
        f = user_model_factory(MlpBn, sigma_mode=d.sigma_mode, sigma_init_ratio=d.sigma_init_ratio,
                               seed=cfg.experiment.seed, input_shape=dataset.input_shape)
        factory = lambda _ds: f  # noqa: E731

    def build(**kw: Any) -> Simulator:
        sim = Simulator(cfg, out, dataset=dataset, model=factory, **kw)
        if job["attack"] == OVERSIZE:
            inner, victim = sim.transport, min(range(cfg.federation.clients))

            def hostile(downlinks: Any, round_idx: int) -> Any:
                replies = inner(downlinks, round_idx)
                if victim in replies and isinstance(replies[victim], bytes) and round_idx == 0:
                    replies[victim] = oversize(replies[victim])
                return replies

            sim.transport = hostile
        return sim

    half = job["rounds"] // 2
    res: dict[str, Any] = {"stopped": False, "resume_ok": None, "error": None}

    def stop(row: dict[str, Any]) -> None:
        if int(row["round"]) == half:
            raise Stop

    try:
        build(on_round=stop).run()
        res["resume_ok"] = None  # not stopped: a run shorter than 2 rounds
    except Stop:
        try:
            rows = build(resume=True).run()
            res["resume_ok"] = len(rows) == job["rounds"]
        except Exception as err:  # noqa: BLE001 (the benchmark records every failure)
            res["resume_ok"], res["error"] = False, f"{type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001
        res["stopped"], res["error"] = True, f"{type(err).__name__}: {err}"
    rows = metrics_rows(out)
    res["accuracy"] = float(rows[-1]["accuracy"]) if rows else None
    res["val_accuracy"] = float(rows[-1]["val_accuracy"]) if rows and rows[-1].get("val_accuracy") else None
    res["rounds_done"] = len(rows)
    res["clients_rejected"] = int(sum(float(r.get("clients_rejected") or 0) for r in rows))
    res["up_bits"] = float(sum(float(r["up_bits"]) for r in rows))
    res["hostile"] = hostile_clients(cfg)
    return res


def run_strategy(job: dict[str, Any], cfg: Any, dataset: Any, out: Path) -> dict[str, Any]:
    from flwr.app import ArrayRecord, Message
    from flwr.clientapp import ClientApp

    import dturbo
    import dturbo.flower as dflower
    from dturbo.algorithms.registry import model_factory
    from dturbo.algorithms.statistics import is_request
    from dturbo.attacks import hostile_clients
    from dturbo.federation import build_federation
    from dturbo.flower.inprocess import HostileGrid
    from dturbo.sim import evaluate

    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower's per-round summaries: the row says it
    fed = build_federation(cfg, dataset)
    if job["model"] == "bn":
        def net() -> Any:
            return dturbo.bayesianize(MlpBn(), sigma_mode=cfg.dturbo.sigma_mode,
                                      sigma_init_ratio=cfg.dturbo.sigma_init_ratio)
        server_model: Any = MlpBn
    else:
        build = model_factory(cfg, dataset.input_shape, dataset.num_classes)
        net = server_model = build
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Any) -> Message:
        return dflower.fit(msg, context, net(), fed.clients[int(context.node_config["partition-id"])])

    @app.query("dturbo")
    def count(msg: Message, context: Any) -> Message:
        return dflower.count_samples(msg, context, fed.clients[int(context.node_config["partition-id"])])

    hostile = set(hostile_clients(cfg)) if job["attack"] != OVERSIZE else {0}
    plain = cfg.model_copy(update={"faults": type(cfg.faults)()})  # what the strategy runs: no injected faults

    class Grid(HostileGrid):
        """The attack of ``cfg``, or one reply of 200 MB in round 1."""

        def rewrite(self, upload: bytes, downlink: bytes, view: Any) -> bytes:
            if job["attack"] == OVERSIZE:
                return oversize(upload) if view().round_idx == 0 and not is_request(downlink) else upload
            return super().rewrite(upload, downlink, view)

    booked: dict[int, Any] = {}  # every round's train metrics, of both starts

    class Recording(dflower.DturboStrategy):
        def aggregate_train(self, server_round: int, replies: Any) -> Any:
            arrays, record = super().aggregate_train(server_round, replies)
            if record is not None:
                booked[server_round + self.session.done] = record
            return arrays, record

    def strategy_() -> Any:
        return Recording(server_model, algorithm=job["method"], config=plain, total_samples=fed.total_samples,
                         fraction_evaluate=0.0, checkpoint=out / "checkpoint")

    shutil.rmtree(out, ignore_errors=True)
    strategy = strategy_()
    grid = Grid(app, cfg.federation.clients, cfg, lambda: strategy.session.server, hostile=hostile)
    half = job["rounds"] // 2
    res: dict[str, Any] = {"stopped": False, "resume_ok": None, "error": None}

    def stop(server_round: int, arrays: Any) -> None:
        if server_round == half:
            raise Stop

    # cut after round `half`, then a new strategy on the same nodes continues from its checkpoint (as the simulator
    # rows resume theirs)
    try:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=job["rounds"], evaluate_fn=stop)
    except Stop:
        try:
            strategy = strategy_()
            rest = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=job["rounds"])
            res["resume_ok"] = sorted(rest.train_metrics_clientapp) == list(range(half + 1, job["rounds"] + 1))
        except Exception as err:  # noqa: BLE001 (the benchmark records every failure)
            res["resume_ok"], res["error"] = False, f"{type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001
        res["stopped"], res["error"] = True, f"{type(err).__name__}: {err}"
    res["rounds_done"] = len(booked)
    res["clients_rejected"] = int(sum(m.get("clients_rejected", 0) for m in booked.values()))
    res["up_bits"] = float(sum(m.get("up_bits", 0) for m in booked.values()))
    res["accuracy"] = (float(evaluate(strategy.global_model(), fed.x_test, fed.y_test)[0])
                       if strategy.session is not None else None)
    res["hostile"] = sorted(hostile)
    (out).mkdir(parents=True, exist_ok=True)
    return res


def run_job(job: dict[str, Any], work: str) -> dict[str, Any]:
    """One run in this (fresh) process; its result is cached under ``work``."""
    import warnings

    import torch

    from dturbo.data import load_dataset

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    out = Path(work) / "runs" / key(job).replace("/", "_")
    cache = Path(work) / "rows" / (key(job).replace("/", "_") + ".json")
    if cache.exists():
        return json.loads(cache.read_text())
    cfg = config(job)
    dataset = load_dataset("fashion-mnist", dataset_path(), limit_train=3000, limit_test=1000,
                           seed=cfg.experiment.seed)
    t0 = time.perf_counter()
    res = (run_simulator if job["runner"] == "simulator" else run_strategy)(job, cfg, dataset, out)
    res |= {**job, "seconds": round(time.perf_counter() - t0, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(res))
    print(f"[{datetime.now():%H:%M:%S}] {key(job)}: acc {res['accuracy']}, stopped {res['stopped']}, resume "
          f"{res['resume_ok']}, rejected {res.get('clients_rejected')}, {res['seconds']} s, "
          f"{res['peak_rss_mb']} MB {res['error'] or ''}", flush=True)
    return res



# ------------------------------------------------------------------------------------------------ report
SEED_FIELDS = ("seed", "accuracy", "stopped", "resume_ok", "peak_rss_mb", "error", "rounds_done", "clients_rejected",
               "up_bits", "hostile", "seconds", "machine")  # what a report keeps of each seed's run (--reuse reads it)


def over_seeds(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per row: accuracy the mean over its seeds' runs (None if any has none), stopped if any stopped,
    the resume failed if any failed, the highest peak memory; each seed's run under ``by_seed``."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        rows.setdefault(row_key(r), []).append(r)
    out = []
    for runs in rows.values():
        runs.sort(key=lambda r: r.get("seed", 0))
        accs = [r["accuracy"] for r in runs]
        resumes = [r["resume_ok"] for r in runs]
        peaks = [r["peak_rss_mb"] for r in runs if r.get("peak_rss_mb") is not None]
        out.append({k: v for k, v in runs[0].items() if k != "seed"} | {
            "accuracy": None if None in accs else round(sum(accs) / len(accs), 4),
            "stopped": next((r["stopped"] for r in runs if r["stopped"]), runs[0]["stopped"]),
            "resume_ok": None if None in resumes else all(resumes),
            "peak_rss_mb": max(peaks, default=None), "error": next((r["error"] for r in runs if r.get("error")), None),
            "seconds": round(sum(r.get("seconds") or 0 for r in runs), 1), "seeds": [r.get("seed", 0) for r in runs],
            "by_seed": [{k: r.get(k, 0 if k == "seed" else None) for k in SEED_FIELDS} for r in runs]})
    return out


def committed_runs(methods: list[str], rounds: int) -> list[dict[str, Any]]:
    """The runs of ``methods``' rows as the committed attacks.json keeps them (each seed's, from ``by_seed``; a
    report of one seed keeps seed 0's in the row itself), for ``--reuse``: refused where that file's rule for a
    method is not today's or its rounds are not ``rounds``."""
    res = json.loads((RESULTS / "attacks.json").read_text())
    wrong = [m for m in methods if res["recommended"].get(m) != RECOMMENDED[m]]
    if wrong or res["rounds"] != rounds:
        raise SystemExit(f"--reuse: the committed attacks.json ran {res['rounds']} rounds (asked: {rounds}) and its "
                         f"rules for {wrong or 'none'} are not today's RECOMMENDED; run those rows instead")
    internal = {v: k for k, v in SCHEMA_RUNNER.items()}
    head = ("runner", "model", "method", "attack", "attackers")

    def seeds(row: dict[str, Any], fallback: dict[str, Any]) -> list[dict[str, Any]]:
        return row.get("by_seed") or [{k: fallback.get(k, 0 if k == "seed" else None) for k in SEED_FIELDS}]

    out = []
    for row, detail in zip(res["runs"], res["details"], strict=True):
        if row["method"] in methods:
            job = {k: detail[k] for k in head} | {"runner": internal[row["runner"]], "rounds": rounds}
            out += [job | run for run in seeds(detail, row | detail)]
    for c in res["clean"]:
        if c["method"] in methods:
            job = {"runner": c["runner"], "model": c["model"], "method": c["method"], "attack": "none",
                   "attackers": 0, "rounds": rounds}
            out += [job | run for run in seeds(c, c | {"stopped": bool(c.get("error")), "resume_ok": None})]
    for c in res.get("cost_without_attackers", []):
        if c["method"] in methods:
            job = {"runner": "simulator", "model": c["model"], "method": c["method"], "attack": "none",
                   "attackers": 0, "candidate": "mean", "rounds": rounds}
            out += [job | run for run in seeds(c.get("mean") or {}, {"accuracy": c["mean_accuracy"],
                                                                     "stopped": False, "resume_ok": None})]
    machine = f"committed attacks.json of {res['date']}"
    return [{k: v for k, v in r.items() if not (k == "seed" and not v)} | {"machine": r.get("machine") or machine}
            for r in out]


def report(results: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    results = over_seeds(results)
    plain = {(r["model"], r["method"]): r for r in results if r.get("candidate") == "mean"}
    results = [r for r in results if r.get("candidate") != "mean"]
    clean = {(r["runner"], r["model"], r["method"]): r for r in results if r["attack"] == "none"}
    cost = [{"model": model, "method": method, "rule": rule_name(method), "mean_accuracy": p["accuracy"],
             "accuracy": clean.get(("simulator", model, method), {}).get("accuracy"),
             "mean": {"by_seed": p["by_seed"]}}
            for (model, method), p in plain.items()]
    rows, details = [], []
    for r in results:
        if r["attack"] == "none":
            continue
        c = clean.get((r["runner"], r["model"], r["method"]), {})
        rows.append({"runner": SCHEMA_RUNNER[r["runner"]], "model": r["model"], "method": r["method"],
                     "attack": r["attack"], "attackers": r["attackers"], "robust": True, "rule": rule_name(r["method"]),
                     "stopped": bool(r["stopped"]), "resume_ok": r["resume_ok"], "accuracy": r["accuracy"],
                     "clean_accuracy": c.get("accuracy"), "peak_rss_mb": r["peak_rss_mb"],
                     "clean_peak_rss_mb": c.get("peak_rss_mb")})
        details.append({k: r.get(k) for k in ("runner", "model", "method", "attack", "attackers", "error",
                                              "rounds_done", "clients_rejected", "up_bits", "hostile", "seconds",
                                              "seeds", "by_seed")}
                       | {"machine": r.get("machine", HERE_MACHINE)})
    assert all(tuple(row) == ROW for row in rows)
    misses, memory = [], []
    for row in rows:
        if row["stopped"] or row["resume_ok"] is False:
            misses.append((key(row), "stopped" if row["stopped"] else "resume failed"))
            continue
        if row["accuracy"] is None or row["clean_accuracy"] is None:
            continue
        # in points at the test set's resolution (1000 images: 0.1 point), so that 0.781 - 0.741 is 4.0, not 4.0000001
        drop = round(100 * (row["clean_accuracy"] - row["accuracy"]), 1)
        if row["attack"] != OVERSIZE and drop > GOAL["points"][row["attackers"]]:
            misses.append((key(row), f"{drop:.1f} points"))
        if row["clean_peak_rss_mb"] and row["peak_rss_mb"] > GOAL["memory_ratio"] * row["clean_peak_rss_mb"]:
            memory.append((key(row), round(row["peak_rss_mb"] / row["clean_peak_rss_mb"], 2)))
    return {"runs": rows, "details": details, "clean": [
        {k: c.get(k) for k in ("runner", "model", "method", "accuracy", "peak_rss_mb", "seconds", "error", "seeds",
                               "by_seed")}
        for c in clean.values()],
        "seeds": sorted({s for r in results for s in r["seeds"]}),
        "recommended": RECOMMENDED, "cost_without_attackers": cost, "rounds": rounds, "goal": GOAL,
        "missed": {"accuracy_or_stop": misses, "memory": memory},
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
        "python": platform.python_version()}


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# Attacks inside the bounds ({res['rounds']} rounds, 10 clients, Fashion-MNIST 3000 images)", "",
             f"Written by `benchmarks/attacks_inside.py` on {res['date']}. Each method with its recommended rule; "
             f"accuracy of the run against its clean run (same runner, model, method and rule), each the mean over "
             f"{_seeds(res)}; goal: within "
             "2 points with 1 attacker, 4 with 3, no stop, resume working (simulator), peak memory at most 2x.", "",
             "| runner | model | method | rule | attack | attackers | accuracy | clean | points | stopped | resume | "
             "peak MB (clean) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        pts = ("" if r["accuracy"] is None or r["clean_accuracy"] is None
               else f"{100 * (r['clean_accuracy'] - r['accuracy']):+.1f}")
        acc = "" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
        cl = "" if r["clean_accuracy"] is None else f"{100 * r['clean_accuracy']:.1f}%"
        resume = {True: "ok", False: "failed", None: "n/a"}[r["resume_ok"]]
        lines.append(f"| {r['runner']} | {r['model']} | {r['method']} | {r['rule']} | {r['attack']} | "
                     f"{r['attackers']} | {acc} | {cl} | {pts} | {r['stopped']} | {resume} | "
                     f"{r['peak_rss_mb']:.0f} ({r['clean_peak_rss_mb'] or 0:.0f}) |")
    m = res["missed"]
    lines += ["", f"Rows that miss the accuracy goal or stop: {len(m['accuracy_or_stop'])} of {len(res['runs'])}"
              + ("" if not m["accuracy_or_stop"] else ": " + "; ".join(f"{k} ({why})" for k, why in
                                                                      m["accuracy_or_stop"])) + ".",
              f"Rows over 2x the clean run's peak memory: {len(m['memory'])}"
              + ("" if not m["memory"] else ": " + "; ".join(f"{k} ({x}x)" for k, x in m["memory"])) + "."]
    j = res.get("main_job")
    if j:
        lines += ["", f"Without attackers, on the main job (`--preset quick`, one torch thread): D-Turbo-VBI with "
                      f"{j['rule']} ends at {100 * j['accuracy']:.2f}%, the plain mean at "
                      f"{100 * j['main_job_accuracy']:.2f}% ({j['cost_points']:+.2f} points; goal: at most "
                      f"{j['goal_points']:g})."]
    return "\n".join(lines) + "\n"


def _seeds(res: dict[str, Any]) -> str:
    seeds = res.get("seeds", [0])
    return f"seed {seeds[0]}" if len(seeds) == 1 else "seeds " + ", ".join(map(str, seeds))


def summary(res: dict[str, Any]) -> str:
    """docs/robustness.md's table: per method and runner, the points each attack costs with 1 / 3 attackers, and
    the 200 MB reply's peak memory against the clean run's."""
    cells: dict[tuple[str, str], dict[str, list[str]]] = {}
    for r in res["runs"]:
        row = cells.setdefault((r["method"], r["runner"]), {})
        if r["stopped"] or r["resume_ok"] is False:
            text = "stopped" if r["stopped"] else "resume failed"
        elif r["attack"] == OVERSIZE:
            text = f"{r['peak_rss_mb'] / r['clean_peak_rss_mb']:.2f}x"
        else:
            text = f"{100 * (r['clean_accuracy'] - r['accuracy']):+.1f}"
        row.setdefault(r["attack"], []).append(text)
    cost: dict[str, list[str]] = {}
    for c in res.get("cost_without_attackers", []):
        if None not in (c["accuracy"], c["mean_accuracy"]):
            cost.setdefault(c["method"], []).append(f"{100 * (c['mean_accuracy'] - c['accuracy']):+.1f}")
    attacks = [*ATTACKS["mlp"], *ATTACKS["bn"]]
    lines = ["| method | runner | " + " | ".join(attacks) + " | 200 MB reply: memory | no attack: rule's cost |",
             "|---|---|" + "---|" * (len(attacks) + 2)]
    for (method, runner), row in cells.items():
        lines.append(f"| {method} | {runner} | " + " | ".join(" / ".join(row.get(a, ["n/a"])) for a in attacks)
                     + f" | {' '.join(row.get(OVERSIZE, ['n/a']))} | "
                     + (" / ".join(cost.get(method, ["n/a"])) if runner == "sim" else "") + " |")
    m = res["missed"]["accuracy_or_stop"]
    lines += ["", f"mlp: scaled_sign_flip, alie, ipm; bn (the mlp with BatchNorm): plain_state, calibration; "
                  f"{res['rounds']} rounds; each run and its clean run the mean over {_seeds(res)}. Goal: within 2 "
                  f"points with 1 attacker, 4 with 3: "
                  f"{len(res['runs']) - len(m)} of {len(res['runs'])} rows. No attack: points below the plain mean "
                  f"(mlp / bn, simulator)."]
    return "\n".join(lines) + "\n"



def rule_jobs(method: str, candidate: str, rounds: int, seed: int = 0) -> list[dict[str, Any]]:
    """The seven validation runs of :data:`CANDIDATE_RUNS` for one method under one candidate rule."""
    return [{"runner": "simulator", "model": model, "method": method, "attack": a, "attackers": k,
             "candidate": candidate, "rounds": rounds} | ({"seed": seed} if seed else {})
            for model, a, k in CANDIDATE_RUNS]


def candidate_jobs(rounds: int, rules: tuple[str, ...] = tuple(CANDIDATES)) -> list[dict[str, Any]]:
    return [j for rule in rules for m in CANDIDATE_METHODS for j in rule_jobs(m, rule, rounds)]


def screen_report(results: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Per method, the mean validation accuracy of its seven runs under each of :data:`SCREENS`; the highest is
    chosen (a tie: the earlier, simpler one)."""
    def mean(m: str, cand: str) -> float | None:
        vals = [r["val_accuracy"] for r in results if r["method"] == m and r["candidate"] == cand]
        return float(sum(vals) / len(vals)) if len(vals) == len(CANDIDATE_RUNS) and None not in vals else None

    table = {m: {c: mean(m, c) for c in SCREENS} for m in CANDIDATE_METHODS}
    chosen = {m: max(SCREENS, key=lambda c, v=v: (round(v[c], 6), -list(SCREENS).index(c)))
              for m, v in table.items() if None not in v.values()}
    return {"what": "each method's rule alone, with robust.min_cosine = 0 first, and with robust.refuse_median = 10 "
                    "as well, 3 attackers of 10, on the validation split (10% of the 3000 training images held out)",
            "rounds": rounds, "screens": SCREENS, "results": table, "chosen": chosen,
            "date": datetime.now(UTC).isoformat(timespec="seconds")}


def screen_markdown(res: dict[str, Any]) -> str:
    lines = [f"# The screens on each method's rule: validation accuracy ({res['rounds']} rounds)", "",
             "Written by `benchmarks/attacks_inside.py --stage screen`: the mean final validation accuracy of a "
             "method's seven runs (as robust_candidates.md) under its rule alone; with the uploads whose update "
             "has a negative cosine with the round's median update left out first (screen); and with those whose "
             "update norm is above 10 times the round's median left out as well (refuse). The chosen in bold.", "",
             "| method | rule | rule + screen | rule + screen + refuse |", "|---|---|---|---|"]
    for m, v in res["results"].items():
        cells = ["-" if v[c] is None else f"{100 * v[c]:.1f}" for c in SCREENS]
        if m in res["chosen"]:
            i = list(SCREENS).index(res["chosen"][m])
            cells[i] = f"**{cells[i]}**"
        lines.append(f"| {m} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


CONFIRM_SEEDS = (1, 2)


@dataclass(frozen=True)
class RuleRound:
    """A round of robust rules fixed before its runs: per method, its rule before the round (``before``: its label,
    a candidate of an earlier round) against the round's ``candidates``, on the seven validation runs of
    :data:`CANDIDATE_RUNS`. The highest mean validation accuracy on seed 0 is chosen (a tie: the earlier); a candidate
    that beats the rule before meets it again over seeds 0-2 (:meth:`confirm_jobs`), and keeps its win only with a
    higher mean there."""

    number: str
    before: dict[str, str]
    candidates: dict[str, dict[str, dict[str, Any]]]
    names: dict[str, str]

    def labels(self, m: str) -> tuple[str, ...]:
        return (self.before[m], *self.candidates[m])

    def jobs(self, rounds: int) -> list[dict[str, Any]]:
        return [j for m in CANDIDATE_METHODS for c in self.labels(m) for j in rule_jobs(m, c, rounds)]

    def confirm_jobs(self, results: list[dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
        """Seeds 1 and 2 of the seven runs, under the rule before and the candidate that beats it on seed 0, for
        each method where one does: a choice made on one seed's runs is confirmed on three."""
        res = self.report(results, rounds)
        return [j for m, pick in res["seed0_chosen"].items() if pick != self.before[m]
                for c in (self.before[m], pick) for seed in CONFIRM_SEEDS for j in rule_jobs(m, c, rounds, seed)]

    def report(self, results: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
        def mean(m: str, cand: str, seeds: tuple[int, ...] = (0,)) -> float | None:
            vals = [r["val_accuracy"] for r in results
                    if r["method"] == m and r["candidate"] == cand and r.get("seed", 0) in seeds]
            full = len(vals) == len(CANDIDATE_RUNS) * len(seeds) and None not in vals
            return float(sum(vals) / len(vals)) if full else None

        table = {m: {c: mean(m, c) for c in self.labels(m)} for m in CANDIDATE_METHODS}
        runs: dict[str, dict[str, float]] = {}
        for r in results:
            if not r.get("seed"):
                runs.setdefault(f"{r['model']}/{r['method']}/{r['attack']}/{r['attackers']}", {})[r["candidate"]] = \
                    r["val_accuracy"]
        seed0 = {m: max(v, key=lambda c, v=v: (round(v[c], 6), -list(v).index(c)))
                 for m, v in table.items() if None not in v.values()}
        seeds = (0, *CONFIRM_SEEDS)
        confirmed = {m: {c: mean(m, c, seeds) for c in (self.before[m], pick)} for m, pick in seed0.items()
                     if pick != self.before[m]}
        chosen = dict(seed0)
        for m, v in confirmed.items():
            first = self.before[m]
            chosen[m] = first if None in v.values() or v[first] >= v[seed0[m]] else seed0[m]
        return {"what": f"each method's rule before the {self.number} round against the round's candidates, 3 "
                        "attackers of 10, on the validation split (10% of the 3000 training images held out); a "
                        "candidate that wins on seed 0 is compared with the rule before again over seeds 0-2",
                "rounds": rounds, "before": {m: rule_of({"method": m, "candidate": c}) for m, c in self.before.items()},
                "candidates": self.candidates, "results": table, "runs": dict(sorted(runs.items())),
                "seed0_chosen": seed0, "confirmed": confirmed, "chosen": chosen,
                "date": datetime.now(UTC).isoformat(timespec="seconds")}

    def markdown(self, res: dict[str, Any]) -> str:
        names = self.names
        lines = [f"# Robust rules, {self.number} round: validation accuracy ({res['rounds']} rounds)", "",
                 f"Written by `benchmarks/attacks_inside.py --stage {self.number}`: the mean final validation accuracy "
                 "of a method's seven runs (as robust_candidates.md) under its rule before the round and under each of "
                 f"the round's candidates (the rules in robust_{self.number}.json). The chosen in bold.", "",
                 "| method | candidate | mean validation accuracy |", "|---|---|---|"]
        for m, v in res["results"].items():
            for c, acc in v.items():
                cell = "-" if acc is None else f"{100 * acc:.1f}"
                lines.append(f"| {m} | {names[c]} | {f'**{cell}**' if res['chosen'].get(m) == c else cell} |")
        for m, v in res.get("confirmed", {}).items():
            cells = ", ".join(f"{names[c]} {'-' if x is None else f'{100 * x:.1f}'}" for c, x in v.items())
            lines += ["", f"{m}: seed 0 chose {names[res['seed0_chosen'][m]]}; over seeds 0-2: {cells}; chosen: "
                          f"{names[res['chosen'][m]]}."]
        shown = [c for c in names if any(c in v for v in res["runs"].values())]
        lines += ["", "Each run's final validation accuracy (%):", "",
                  "| run | " + " | ".join(names[c] for c in shown) + " |", "|---|" + "---|" * len(shown)]
        lines += [f"| {k} | " + " | ".join("" if v.get(c) is None else f"{100 * v[c]:.1f}" for c in shown) + " |"
                  for k, v in res["runs"].items()]
        return "\n".join(lines) + "\n"


SECOND_ROUND = RuleRound("second", {m: "first" for m in FIRST}, SECOND, {
    "first": "first round's rule", "rule_mean": "screened against the mean update",
    "rule_mean03": "the same, cosine at least 0.3", "mean_masks": "the plain mean of the screened masks"})
THIRD_ROUND = RuleRound("third", SECOND_CHOSEN, THIRD, {
    **SECOND_ROUND.names, "floor05": "updates shorter than 0.5 times the median refused",
    "floor03": "updates shorter than 0.3 times the median refused"})
FOURTH_ROUND = RuleRound("fourth", THIRD_CHOSEN, FOURTH, {
    **THIRD_ROUND.names, "close01": "updates within 0.1 times the median distance of another's refused"})


def candidates_report(results: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Each candidate's mean validation accuracy, clean and under attack, by method and over them all; each
    method's choice (its candidate of highest mean; ties: the one listed first)."""
    def mean(rs: list[dict[str, Any]]) -> float:
        return float(sum(r["val_accuracy"] for r in rs) / len(rs))

    by = {rule: [r for r in results if r.get("candidate") == rule] for rule in CANDIDATES}
    table = {rule: {"mean_val_accuracy": mean(rs),
                    "by_method": {m: mean([r for r in rs if r["method"] == m]) for m in CANDIDATE_METHODS},
                    "runs": {f"{r['model']}/{r['method']}/{r['attack']}/{r['attackers']}": r["val_accuracy"]
                             for r in rs},
                    "stopped": [key(r) for r in rs if r["stopped"] or r["resume_ok"] is False]}
             for rule, rs in by.items()
             if len(rs) == len(CANDIDATE_METHODS) * len(CANDIDATE_RUNS) and all(r["val_accuracy"] is not None
                                                                               for r in rs)}
    chosen = {m: max(table, key=lambda rule, m=m: table[rule]["by_method"][m]) for m in CANDIDATE_METHODS} \
        if table else {}
    return {"what": "robust rules for 3 attackers of 10, chosen on the validation split (10% of the 3000 training "
                    "images held out)", "rounds": rounds, "candidates": {k: CANDIDATES[k] for k in table},
            "results": table, "chosen": chosen, "date": datetime.now(UTC).isoformat(timespec="seconds")}


def candidates_markdown(res: dict[str, Any]) -> str:
    rules = list(res["results"])
    lines = [f"# Robust rules against 3 of 10 attackers: validation accuracy ({res['rounds']} rounds)", "",
             "Written by `benchmarks/attacks_inside.py --stage candidates`. Each cell: the mean final validation "
             "accuracy of a method's seven runs (the mlp clean and under the scaled sign flip, ALIE and IPM; the mlp "
             "with BatchNorm clean and under poisoned state and calibration statistics; 3 attackers of 10); each "
             "method takes its highest, in bold.", "",
             "| method | " + " | ".join(rules) + " |", "|---|" + "---|" * len(rules)]
    for m, pick in res["chosen"].items():
        cells = [f"{100 * res['results'][r]['by_method'][m]:.1f}" for r in rules]
        lines.append(f"| {m} | " + " | ".join(f"**{c}**" if r == pick else c for r, c in zip(rules, cells,
                                                                                              strict=True)) + " |")
    lines.append("| all | " + " | ".join(f"{100 * res['results'][r]['mean_val_accuracy']:.1f}" for r in rules) + " |")
    runs = sorted({k for t in res["results"].values() for k in t["runs"]})
    lines += ["", "Each run's final validation accuracy (%):", "", "| run | " + " | ".join(rules) + " |",
              "|---|" + "---|" * len(rules)]
    lines += [f"| {k} | " + " | ".join(f"{100 * res['results'][r]['runs'][k]:.1f}" for r in rules) + " |"
              for k in runs]
    return "\n".join(lines) + "\n"


# --stage absent: the methods with a row that misses the goal, their attackers' uploads absent (the ``loss`` attack:
# a NaN training loss, refused by the bounds, from the same clients as every attack of the run's seed), under the
# recommended rule, simulator, mlp, seeds 0-2, beside their clean runs: the accuracy a rule that refuses every
# attacker and nothing else ends at. At the matrix's 12 rounds the attacked rows of attacks.json stand beside it;
# with --rounds N it asks whether the loss shrinks with longer training (attacks_absent_N.{json,md}).
ABSENT_METHODS = ("dssm", "fedpm")


def absent_jobs(rounds: int) -> list[dict[str, Any]]:
    return [{"runner": "simulator", "model": "mlp", "method": m, "attack": a, "attackers": k, "rounds": rounds}
            | ({"seed": seed} if seed else {}) for seed in (0, *CONFIRM_SEEDS) for m in ABSENT_METHODS
            for a, k in (("none", 0), *(("loss", k) for k in ATTACKERS))]


def absent_report(results: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Per method and attacker count: the clean run's accuracy, the attackers' uploads absent and, at the matrix's
    rounds, each attack's row of attacks.json (means over seeds 0-2)."""
    matrix = json.loads((RESULTS / "attacks.json").read_text())
    rows = matrix["runs"] if matrix.get("rounds") == rounds else []
    runs = over_seeds(results)
    clean = {r["method"]: r for r in runs if r["attack"] == "none"}
    table = []
    for a in sorted((r for r in runs if r["attack"] == "loss"), key=lambda r: (r["method"], r["attackers"])):
        m, k = a["method"], a["attackers"]
        mine = [r for r in rows if r["runner"] == "sim" and r["model"] == "mlp" and r["method"] == m
                and r["attackers"] == k and r["attack"] in ATTACKS["mlp"]]
        table.append({"method": m, "attackers": k, "rule": rule_name(m), "clean_accuracy": clean[m]["accuracy"],
                      "clean_by_seed": [r["accuracy"] for r in clean[m]["by_seed"]],
                      "absent_accuracy": a["accuracy"], "absent_by_seed": [r["accuracy"] for r in a["by_seed"]],
                      "refused": a["clients_rejected"], "attacks": {r["attack"]: r["accuracy"] for r in mine}})
    return {"what": "the attackers' uploads absent (refused by the bounds: a NaN training loss) under the recommended "
                    "rule: what a rule that refuses every attacker and nothing else ends at", "rounds": rounds,
            "seeds": [0, *CONFIRM_SEEDS], "rows": table, "date": datetime.now(UTC).isoformat(timespec="seconds")}


def absent_markdown(res: dict[str, Any]) -> str:
    def pts(clean: float | None, x: float | None) -> str:
        return "-" if clean is None or x is None else f"{100 * (clean - x):+.1f}"

    def seeds(xs: list[float]) -> str:
        return ", ".join(f"{100 * x:.1f}" for x in xs)

    attacks = any(r["attacks"] for r in res["rows"])
    lines = [f"# The attackers' data lost: their uploads absent ({res['rounds']} rounds, seeds 0-2)", "",
             "Written by `benchmarks/attacks_inside.py --stage absent`: for the methods with a row of attacks.md that "
             "misses the goal, the same attackers send a NaN training loss, which the bounds refuse, so the round "
             "aggregates the honest uploads alone: what a rule that refuses every attacker and nothing else ends at. "
             "Points below the clean run (all ten clients' data), means over the seeds"
             + ("; beside them, the attacked rows of attacks.md." if attacks else "."), "",
             "| method | attackers | clean (by seed) | attackers absent (by seed) | points |"
             + (" " + " | ".join(ATTACKS["mlp"]) + " |" if attacks else ""),
             "|---|---|---|---|---|" + ("---|" * len(ATTACKS["mlp"]) if attacks else "")]
    for r in res["rows"]:
        c = r["clean_accuracy"]
        lines.append(f"| {r['method']} | {r['attackers']} | {100 * c:.1f}% ({seeds(r['clean_by_seed'])}) | "
                     f"{100 * r['absent_accuracy']:.1f}% ({seeds(r['absent_by_seed'])}) | "
                     f"{pts(c, r['absent_accuracy'])} |"
                     + (" " + " | ".join(pts(c, r["attacks"].get(a)) for a in ATTACKS["mlp"]) + " |"
                        if attacks else ""))
    return "\n".join(lines) + "\n"


MATRIX_ROUNDS = 12  # the matrix's length (the "at least 12 rounds"); a stage at another N writes NAME_N

# --stage NAME: (its jobs, the jobs its results then ask for, its report, the report's markdown, the results file)
ROUNDS = {"candidates": (candidate_jobs, None, candidates_report, candidates_markdown, "robust_candidates"),
          "screen": (lambda rounds: candidate_jobs(rounds, tuple(SCREENS)), None, screen_report, screen_markdown,
                     "robust_screen"),
          **{r.number: (r.jobs, r.confirm_jobs, r.report, r.markdown, f"robust_{r.number}")
             for r in (SECOND_ROUND, THIRD_ROUND, FOURTH_ROUND)},
          "absent": (absent_jobs, None, absent_report, absent_markdown, "attacks_absent")}


def main_job(work: Path) -> dict[str, Any]:
    """The main job (`dturbo run --preset quick`, one torch thread as benchmarks/presets.py runs it) with
    D-Turbo-VBI's recommended rule, against the main job of benchmarks/results/presets.json."""
    import subprocess

    rule = RECOMMENDED["dturbo"]
    out = work / f"main_job_{source_digest(rule)}"
    if not (out / "model.safetensors").exists():
        cmd = [sys.executable, "-m", "dturbo", "run", "--preset", "quick", "--out", str(out), "--no-figures",
               "--set", "experiment.threads=1", *(x for k, v in rule.items()
                                                  for x in ("--set", f"{k}={json.dumps(v)}"))]
        if out.exists():
            cmd.append("--resume")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
        subprocess.run(cmd, env=env, check=True)
    rows = metrics_rows(out)
    reference = json.loads((RESULTS / "presets.json").read_text())["runs"]["quick"]["final_accuracy"]
    acc = float(rows[-1]["accuracy"])
    return {"rule": rule_name("dturbo"), "accuracy": acc, "main_job_accuracy": reference,
            "cost_points": round(100 * (reference - acc), 2), "goal_points": 1.0}


def run_cached(jobs: list[dict[str, Any]], work: Path, only: str, workers: int) -> list[dict[str, Any]]:
    """The rows of ``jobs`` whose key starts with ``only``: each run once into ``work`` (a row already in
    ``work/rows`` is read, not run again), one fresh process a run (its peak RSS is its own)."""
    wanted = [j for j in jobs if key(j).startswith(only)]
    paths = [work / "rows" / (key(j).replace("/", "_") + ".json") for j in wanted]
    todo = [j for j, p in zip(wanted, paths, strict=True) if not p.exists()]
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
        list(pool.map(run_job, todo, [str(work)] * len(todo)))
    return [json.loads(p.read_text()) for p in paths]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=MATRIX_ROUNDS)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "attacks_inside")
    ap.add_argument("--stage", choices=("runs", "main", "report", "all", *ROUNDS), default="all")
    ap.add_argument("--only", default="", help="run the jobs whose key starts with this (runner/model/method/...)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="runs, report: the seeds each row runs on")
    ap.add_argument("--reuse", nargs="+", default=[], choices=list(PRESETS), metavar="METHOD", help=(
        "runs, report: these methods' runs as the committed attacks.json keeps them, not run again (refused where "
        "that file's rule for one is not today's)"))
    args = ap.parse_args()
    for run in committed_runs(args.reuse, args.rounds) if args.reuse else ():
        if run.get("seed", 0) in args.seeds:
            path = args.work / "rows" / (key(run).replace("/", "_") + ".json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(run))
    if args.stage in ROUNDS:  # a round of robust rules: its runs, its choice, its results file
        make_jobs, then, report_, markdown_, name = ROUNDS[args.stage]
        results = run_cached(make_jobs(args.rounds), args.work / args.stage, args.only, args.jobs)
        if then is not None:  # e.g. a seed-0 choice confirmed over 3 seeds
            results += run_cached(then(results, args.rounds), args.work / args.stage, args.only, args.jobs)
        res = report_(results, args.rounds)
        if args.rounds != MATRIX_ROUNDS:  # another length writes beside the matrix's, not over it
            name = f"{name}_{args.rounds}"
        (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
        (RESULTS / f"{name}.md").write_text(markdown_(res))
        print(markdown_(res))
        return
    if args.stage in ("runs", "all"):
        run_cached(jobs(args.rounds, tuple(args.seeds)), args.work, args.only, args.jobs)
    if args.stage in ("main", "all"):
        (args.work / "main_job.json").write_text(json.dumps(main_job(args.work)))
    if args.stage in ("report", "all"):
        cached = [args.work / "rows" / (key(j).replace("/", "_") + ".json") for j in jobs(args.rounds,
                                                                                            tuple(args.seeds))]
        results = [json.loads(p.read_text()) for p in cached if p.exists()]
        res = report(results, args.rounds)
        main_path = args.work / "main_job.json"
        res["main_job"] = json.loads(main_path.read_text()) if main_path.exists() else None
        (RESULTS / "attacks.json").write_text(json.dumps(res, indent=1) + "\n")
        (RESULTS / "attacks.md").write_text(markdown(res))
        (RESULTS / "attacks_summary.md").write_text(summary(res))
        fill_block(ROOT / "docs" / "robustness.md", "benchmarks/results/attacks_summary.md", summary(res))
        print(markdown(res))


if __name__ == "__main__":
    main()

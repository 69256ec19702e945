"""Hostile clients and hostile files against every method: runs that must not stop, accuracy that must hold, memory that
must stay bounded.

    python benchmarks/hostile.py [--rounds 8] [--work runs/attacks] [--stage all|clean|runs|memory|report]

Fashion-MNIST (3000 training images, 1000 test), the mlp (200, 100), 10 clients (Dirichlet 0.5), 2 local epochs, one
torch thread; every method with its preset's settings (D-Turbo-VBI: the main job's ``quick``, warm-up 1 round, ramp
5). The attackers are a fault of the simulator (``[faults] attackers``, ``attack``): they train honestly, then
rewrite their upload.

* ``clean``: each robust rule without attackers (its cost in accuracy).
* ``attacks``: every attack with 1 and 3 attackers, plain mean and the recommended robust setting (each method's rule
  of benchmarks/attacks_inside.py, ``RECOMMENDED``). Every run is stopped after half its rounds (as a crash after a
  checkpoint) and continued with resume; a few are also run uninterrupted and compared row by row.
* ``memory``: peak RSS (``ru_maxrss``) of a fresh process per case: a 2-round run (LeNet-5) with one hostile upload
  in its first round against the same run honest; ``dturbo.export.load`` of hostile model directories and
  ``load_dataset`` of a hostile .npz against honest ones.

Goals: no attack stops a run or its resume; with the robust option every attack the uploads' bounds are for (values,
samples, copy, loss) ends within 2 points of the clean run and every refused upload is counted with a reason; no
upload or model directory makes the peak memory exceed 2x the honest one's. Writes
benchmarks/results/hostile.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import subprocess
import sys
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attacks_inside import RECOMMENDED, rule_name  # noqa: E402  (each method's rule, chosen there on validation)
from harness import dataset_path, fill_block, metrics_rows  # noqa: E402

DATA = dataset_path()

RESULTS = ROOT / "benchmarks" / "results"
METHODS = {"dturbo": "quick", "fedavg": "fedavg", "fedpaq": "fedpaq", "dssm": "dssm", "stc": "stc", "fedpm": "fedpm",
           "feddst": "feddst"}
RULES = ("mean", "median", "trimmed_mean", "krum", "bulyan")
BOUNDED = ("values", "samples", "copy", "loss")  # refused by the uploads' bounds: the accuracy goal's attacks
ATTACKS = (*BOUNDED, "overflow", "spoof", "sign_flip")
REFUSED = ("values", "overflow", "samples", "copy", "loss", "spoof")  # every such upload must be refused
# (a value attack on FedPM inverts its mask, which no bound can tell from an honest one; sign_flip stays in bounds)
ATTACKERS = (1, 3)
GOAL = {"points": 2.0, "memory_ratio": 2.0}
EQUALITY_CHECKS = (("dturbo", "values", 3), ("fedavg", "sign_flip", 3), ("stc", "spoof", 1))


def overrides(method: str, rounds: int) -> dict[str, Any]:
    out = {"experiment.rounds": rounds, "experiment.threads": 1, "data.path": DATA, "data.limit_train": 3000,
           "data.limit_test": 1000, "model.name": "mlp", "train.local_epochs": 2.0}
    if method == "dturbo":  # the quick preset's training as the matrix's runs ran it: a constant rate, "cut"
        out |= {"dturbo.sparsity.warmup_rounds": 1, "dturbo.sparsity.ramp_rounds": max(1, rounds - 3),
                "train.lr_warmup_rounds": 0, "dturbo.global_model": "cut"}
    return out


def config(method: str, rounds: int, extra: dict[str, Any] | None = None) -> Any:
    from dturbo.settings import load_config

    return load_config(preset=METHODS[method], overrides=overrides(method, rounds) | (extra or {}))


class Stop(Exception):
    """Raised after a round is recorded: the run stops there, as a crash after its checkpoint."""


def run(cfg: Any, out: Path, dataset: Any, stop_after: int | None) -> dict[str, Any]:
    """Train into ``out`` (stopped after ``stop_after`` rounds and resumed, when given): the outcome."""
    from dturbo.sim import Simulator

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    outcome: dict[str, Any] = {"stopped": None, "resumed": None}

    def stop(row: dict[str, Any]) -> None:
        if stop_after is not None and int(row["round"]) == stop_after:
            raise Stop

    try:
        Simulator(cfg, out, dataset=dataset, on_round=stop).run()
        outcome["resumed"] = "not stopped"
    except Stop:
        try:
            Simulator(cfg, out, dataset=dataset, resume=True).run()
            outcome["resumed"] = "ok"
        except Exception as err:  # noqa: BLE001 (the benchmark records every failure)
            outcome["resumed"] = f"{type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001
        outcome["stopped"] = f"{type(err).__name__}: {err}"
    outcome["seconds"] = round(time.perf_counter() - t0, 1)
    rows = metrics_rows(out)
    if rows:
        outcome |= {"final_accuracy": float(rows[-1]["accuracy"]), "rounds": int(rows[-1]["round"]),
                    "clients_rejected": int(sum(float(r.get("clients_rejected") or 0) for r in rows)),
                    "cum_bits": float(rows[-1]["cum_bits"])}
    events = out / "events.log"
    outcome["rejections"] = [ln.split(": upload rejected: ", 1) for ln in
                             (events.read_text().splitlines() if events.exists() else []) if "upload rejected" in ln]
    return outcome



def stage_runs(args: argparse.Namespace, attacks: bool = True) -> dict[str, Any]:
    from dturbo.data import load_dataset
    from dturbo.settings import load_config

    warnings.simplefilter("ignore")
    base = load_config(preset="quick", overrides=overrides("dturbo", args.rounds))
    dataset = load_dataset("fashion-mnist", DATA, limit_train=3000, limit_test=1000, seed=base.experiment.seed)
    half = args.rounds // 2
    results: dict[str, Any] = {"clean": {}, "attacks": {}, "equality": {}}
    cache = args.work / "runs.json"
    if cache.exists():
        results = json.loads(cache.read_text())
    for method in METHODS:
        for rule in (*RULES, "recommended"):
            key = f"{method}/{rule}"
            if key in results["clean"]:
                continue
            extra = RECOMMENDED[method] if rule == "recommended" else {"robust.rule": rule, "robust.byzantine": 3}
            cfg = config(method, args.rounds, extra)
            results["clean"][key] = run(cfg, args.work / "clean" / method / rule, dataset, half)
            _say(key, results["clean"][key])
            cache.write_text(json.dumps(results))
    for method in METHODS if attacks else ():
        for attack in ATTACKS:
            for k in ATTACKERS:
                for robust in ("mean", "recommended"):
                    key = f"{method}/{attack}/{k}/{robust}"
                    if key in results["attacks"]:
                        continue
                    extra = {"faults.attackers": k, "faults.attack": attack}
                    if robust == "recommended":
                        extra |= RECOMMENDED[method]
                    cfg = config(method, args.rounds, extra)
                    out = args.work / "attacks" / method / f"{attack}_{k}_{robust}"
                    results["attacks"][key] = run(cfg, out, dataset, half) | {"attackers": _attackers(cfg, out)}
                    _say(key, results["attacks"][key])
                    cache.write_text(json.dumps(results))
    for method, attack, k in EQUALITY_CHECKS if attacks else ():
        key = f"{method}/{attack}/{k}/recommended"
        if key in results["equality"]:
            continue
        cfg = config(method, args.rounds, {"faults.attackers": k, "faults.attack": attack} | RECOMMENDED[method])
        out = args.work / "uninterrupted" / f"{method}_{attack}_{k}"
        run(cfg, out, dataset, None)
        resumed = args.work / "attacks" / method / f"{attack}_{k}_recommended"
        results["equality"][key] = _same_rows(out, resumed)
        _say(f"equal {key}", {"equal": results["equality"][key]})
        cache.write_text(json.dumps(results))
    return results


def _attackers(cfg: Any, out: Path) -> dict[str, Any]:
    """The hostile clients and how many of their uploads reached the server (selected and answered)."""
    from dturbo.attacks import hostile_clients

    hostile = hostile_clients(cfg)
    events = out / "events.log"
    lines = events.read_text().splitlines() if events.exists() else []
    refused = sum(1 for ln in lines if "upload rejected" in ln and int(ln.split("client ")[1].split(":")[0]) in hostile)
    honest_refused = sum(1 for ln in lines if "upload rejected" in ln
                         and int(ln.split("client ")[1].split(":")[0]) not in hostile)
    return {"clients": hostile, "uploads_refused": refused, "honest_refused": honest_refused,
            "selected": _selected(cfg, hostile)}


def _selected(cfg: Any, hostile: list[int]) -> int:
    """Rounds x hostile clients the server selected: their uploads that reached it."""
    from dturbo.algorithms.base import sample_uniform
    from dturbo.algorithms.dssm import dssm_count

    f, seed, n = cfg.federation, cfg.experiment.seed, cfg.federation.clients
    total = 0
    for r in range(cfg.experiment.rounds):
        k = (dssm_count(r, n, cfg.dssm.c0, cfg.dssm.decay, cfg.dssm.min_clients) if cfg.experiment.algorithm == "dssm"
             else f.clients_per_round)
        total += len(set(sample_uniform(seed, r, n, k)) & set(hostile))
    return total


def _same_rows(a: Path, b: Path) -> bool:
    timing = {"seconds", "server_seconds"}
    ra = [{k: v for k, v in r.items() if k not in timing} for r in metrics_rows(a)]
    rb = [{k: v for k, v in r.items() if k not in timing} for r in metrics_rows(b)]
    return bool(ra) and ra == rb


def _say(key: str, outcome: dict[str, Any]) -> None:
    shown = {k: outcome.get(k) for k in ("final_accuracy", "clients_rejected", "stopped", "resumed", "seconds",
                                          "equal") if k in outcome}
    print(f"[{datetime.now():%H:%M:%S}] {key}: {shown}", flush=True)


# ---------------------------------------------------------------------------------------------------- memory
MEMORY_CHILD = r'''
import resource, sys, json, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {src!r})
case, work = {case!r}, {work!r}
{body}
hwm = [int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM")]
print(json.dumps({{"case": case, "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "vmhwm_kb": hwm[0] if hwm else None, "outcome": outcome}}))
'''

SERVER_CASE = r'''
from pathlib import Path
from dturbo.settings import load_config
from dturbo.sim import Simulator
from dturbo.codec import encode_message
from dturbo.transport import InProcessClients
import numpy as np
cfg = load_config(preset="quick", overrides={overrides!r})

def hostile(upload):
    if case == "honest":
        return upload
    if case == "grid_20MB":  # framed as a downlink, one grid field whose rectangle records claim the whole payload
        k = m = 1 << 20
        n = 20 << 20
        head = bytes([1]) + bytes([0x80, 0x80, 0x40]) * 2 + _varint(n // 10) + _varint(0)
        return encode_message("dturbo/down", [("conv1.mu", head + bytes(n))])
    if case == "upload_200MB":
        return upload + bytes(200 << 20)
    if case == "claims":  # every field's counts claim the most the bound allows
        return encode_message("dturbo/up", [(n, bytes([1]) + _varint((1 << 40) - 1) + bytes(64)) for n in
                                            ("meta", "conv1.mu", "conv1.sigma", "conv1.bias", "metrics")])
    raise ValueError(case)

def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)

class Hostile(InProcessClients):
    def __call__(self, downlinks, round_idx):
        replies = super().__call__(downlinks, round_idx)
        if round_idx == 0:
            replies[0] = hostile(replies[0])
        return replies

sim = Simulator(cfg, Path(work) / case)
sim.transport = Hostile(sim.client, sim.fed.clients)
rows = sim.run()
outcome = {{"rounds": len(rows), "rejected": rows[0]["clients_rejected"], "up_bits_round1": rows[0]["up_bits"]}}
'''

LOADER_CASE = r'''
from dturbo.export import ExportError, load
try:
    load(work + "/" + case, batch_size=256, compile=False)
    outcome = "loaded"
except ExportError as err:
    outcome = "ExportError: " + str(err)[:160]
'''

NPZ_CASE = r'''
from dturbo.data import DataError, load_dataset
try:
    load_dataset("npz", work + "/" + case + ".npz")
    outcome = "loaded"
except DataError as err:
    outcome = "DataError: " + str(err)[:160]
'''


def child(case: str, work: Path, body: str) -> dict[str, Any]:
    code = MEMORY_CHILD.format(src=str(ROOT / "src"), case=case, work=str(work), body=body)
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        return {"case": case, "maxrss_kb": None, "outcome": f"exit {done.returncode}: {done.stderr[-300:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


LOADER_CASES = ("honest", "conv_12000", "layernorm_30000", "input_3000", "nested_json", "nan_weights", "json_20MB",
                "symlink_out")


def make_model_dirs(work: Path) -> list[str]:
    """An honest export of a 2-round run and the hostile directories derived from it."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from dturbo.export import export_run

    honest = work / "honest_model"
    export_run(work / "server" / "honest", honest)
    spec = json.loads((honest / "model.json").read_text())
    cases = {}

    def write(name: str, spec_obj: Any, tensors: dict[str, Any] | None = None, raw: str | None = None) -> None:
        d = work / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        (d / "model.json").write_text(raw if raw is not None else json.dumps(spec_obj))
        if tensors is not None:
            save_file(tensors, str(d / "model.safetensors"), metadata={"format": "dturbo-export"})
        cases[name] = True

    tensors = load_file(str(honest / "model.safetensors"))
    shutil.rmtree(work / "honest", ignore_errors=True)
    shutil.copytree(honest, work / "honest")
    conv = json.loads(json.dumps(spec))
    first = next(op for op in conv["ops"] if op["type"] == "conv2d")
    first["in_channels"] = first["out_channels"] = 12000
    write("conv_12000", conv, tensors)
    graph = {"format": "dturbo-export", "version": 4, "kind": "graph", "input_shape": [1, 28, 28],
             "num_classes": 10, "input_norm": None,
             "ops": [{"type": "input", "name": "x", "args": []},
                     {"type": "layer_norm", "name": "ln", "args": [{"ref": "x"}],
                      "attrs": {"normalized_shape": [30000, 30000], "eps": 1e-5, "weight": True, "bias": True}},
                     {"type": "output", "name": "output", "args": [{"ref": "ln"}]}]}
    write("layernorm_30000", graph, {"unused": torch.zeros(1)})
    big_input = json.loads(json.dumps(spec))
    big_input["input_shape"] = [1, 3000, 3000]
    big_input["input_norm"] = None
    write("input_3000", big_input, tensors)
    write("nested_json", None, tensors, raw="[" * 200_000 + "]" * 200_000)
    nan = dict(tensors)
    key = next(k for k in nan if k.endswith(".weight"))
    nan[key] = torch.full_like(nan[key], float("nan"))
    write("nan_weights", spec, nan)
    write("json_20MB", None, tensors, raw=json.dumps({"format": "dturbo-export", "pad": "x" * (20 << 20)}))
    link = work / "symlink_out"
    shutil.rmtree(link, ignore_errors=True)
    link.mkdir()
    (link / "model.json").write_text(json.dumps(spec))
    outside = work / "outside.safetensors"
    shutil.copy(honest / "model.safetensors", outside)
    (link / "model.safetensors").symlink_to(outside)
    cases["symlink_out"] = True
    # npz: an honest small one, and one of 4.2 GB of zeros deflated to a few MB whose labels do not match
    np.savez(work / "npz_honest.npz", x_train=np.zeros((100, 28, 28), np.uint8), y_train=np.arange(100) % 10,
             x_test=np.zeros((20, 28, 28), np.uint8), y_test=np.arange(20) % 10)
    _deflated_npz(work / "npz_deflated.npz")
    return ["honest", *cases]


def _deflated_npz(path: Path) -> None:
    """x_train: 4.2 GB of zeros (1.4e6 x 3000 uint8) written deflated in chunks, y_train of another length."""
    import zipfile

    import numpy as np

    rows, cols = 1_400_000, 3000
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        with z.open("x_train.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False, "shape": (rows, cols)})
            block = bytes(cols * 10_000)
            for _ in range(rows // 10_000):
                f.write(block)
        for name, arr in (("y_train", np.zeros(7, np.int64)), ("x_test", np.zeros((5, 3000), np.uint8)),
                          ("y_test", np.zeros(5, np.int64))):
            with z.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, arr)


def stage_memory(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    work = args.work / "memory"
    shutil.rmtree(work, ignore_errors=True)
    (work / "server").mkdir(parents=True)
    ov = overrides("dturbo", 2) | {"model.name": "lenet5"}  # convolutions, for the hostile model directories
    server = {}
    for case in ("honest", "grid_20MB", "upload_200MB", "claims"):
        server[case] = child(case, work / "server", SERVER_CASE.format(overrides=ov))
        print(f"[{datetime.now():%H:%M:%S}] memory server {case}: {server[case]}", flush=True)
    # The directories are made by a process of their own: a child's ru_maxrss starts at its parent's peak (Linux keeps
    # it across fork and exec), so this one stays small.
    subprocess.run([sys.executable, __file__, "--stage", "dirs", "--work", str(args.work)], check=True,
                   env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    loader = {}
    for case in LOADER_CASES:
        loader[case] = child(case, work, LOADER_CASE)
        print(f"[{datetime.now():%H:%M:%S}] memory loader {case}: {loader[case]}", flush=True)
    data = {}
    for case in ("npz_honest", "npz_deflated"):
        data[case] = child(case, work, NPZ_CASE)
        print(f"[{datetime.now():%H:%M:%S}] memory data {case}: {data[case]}", flush=True)
    return {"server": server, "loader": loader, "data": data, "seconds": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------------------------------------------- report
def main_job_goal() -> dict[str, Any]:
    """The goal that D-Turbo-VBI's recommended rule costs at most 1 point on the main job: the run
    benchmarks/attacks_inside.py makes of it (``--stage main``; the same rule), as its attacks.json keeps it."""
    path = RESULTS / "attacks.json"
    main_job = json.loads(path.read_text()).get("main_job") if path.exists() else None
    if not main_job or main_job.get("rule") != rule_name("dturbo"):
        return {"met": None}
    return {"met": main_job["cost_points"] <= main_job["goal_points"], **main_job}


def report(runs: dict[str, Any], memory: dict[str, Any], args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    clean = {m: runs["clean"][f"{m}/mean"]["final_accuracy"] for m in METHODS}
    cost = {m: {r: round(100 * (runs["clean"][f"{m}/{r}"]["final_accuracy"] - clean[m]), 2)
                for r in (*RULES, "recommended")} for m in METHODS}
    stops = [k for k, v in {**runs["clean"], **runs["attacks"]}.items()
             if v.get("stopped") or v.get("resumed") not in ("ok", "not stopped")]
    drops, drops_same, uncounted = {}, {}, []
    for key, v in runs["attacks"].items():
        method, attack, k, robust = key.split("/")
        if robust == "recommended" and attack in BOUNDED:
            drops[key] = round(100 * (clean[method] - v.get("final_accuracy", 0.0)), 2)
            same = runs["clean"][f"{method}/recommended"]["final_accuracy"]
            drops_same[key] = round(100 * (same - v.get("final_accuracy", 0.0)), 2)
        if attack in REFUSED and not (method == "fedpm" and attack in ("values", "overflow")):
            a = v["attackers"]
            if a["uploads_refused"] != a["selected"] or v.get("clients_rejected", 0) < a["selected"]:
                uncounted.append(key)
    ratios = {}
    for part, honest in (("server", "honest"), ("loader", "honest"), ("data", "npz_honest")):
        base = memory[part][honest]["maxrss_kb"]
        for case, r in memory[part].items():
            if case != honest and r["maxrss_kb"]:
                ratios[f"{part}/{case}"] = round(r["maxrss_kb"] / base, 2)
    goals = {
        "no_stop": {"met": not stops, "runs_that_stopped": stops},
        "within_2_points": {"met": all(d <= GOAL["points"] for d in drops.values()),
                            "worst": max(drops.items(), key=lambda kv: kv[1]) if drops else None,
                            "missed": {k: d for k, d in drops.items() if d > GOAL["points"]},
                            "worst_against_the_rules_clean_run": max(drops_same.items(), key=lambda kv: kv[1])
                            if drops_same else None},
        "refused_counted": {"met": not uncounted, "uncounted": uncounted},
        "memory_2x": {"met": all(r <= GOAL["memory_ratio"] for r in ratios.values()),
                      "worst": max(ratios.items(), key=lambda kv: kv[1]) if ratios else None},
        "equality_after_resume": runs["equality"],
        "main_job_cost_at_most_1_point": main_job_goal(),
    }
    for part in ("clean", "attacks"):  # the reasons each run's refusals gave, once each
        for v in runs[part].values():
            v["rejections"] = sorted({why[:90] for _, why in v.get("rejections", [])})[:6]
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
            "python": platform.python_version(), "rounds": args.rounds, "seconds": round(seconds),
            "recommended": RECOMMENDED, "clean_accuracy": clean, "robust_cost_points": cost,
            "accuracy_drop_points": drops, "accuracy_drop_points_against_the_rules_clean_run": drops_same,
            "memory_ratio": ratios, "goals": goals, "runs": runs, "memory": memory}


def markdown(res: dict[str, Any]) -> str:
    methods = list(METHODS)
    lines = [f"# Hostile clients and files ({res['rounds']} rounds, 10 clients, Fashion-MNIST 3000 images, mlp)",
             "", f"Written by `benchmarks/hostile.py` on {res['date']} in {res['seconds']} s.", "",
             "## Goals", "", "| goal | met | detail |", "|---|---|---|"]
    g = res["goals"]
    lines += [f"| no attack stops a run or its resume | {g['no_stop']['met']} | {g['no_stop']['runs_that_stopped']} |",
              f"| robust (recommended): bounded attacks within 2 points of the clean run | "
              f"{g['within_2_points']['met']} | worst {g['within_2_points']['worst']} |",
              f"| every refused hostile upload counted with a reason | {g['refused_counted']['met']} | "
              f"{g['refused_counted']['uncounted']} |",
              f"| peak memory at most 2x the honest one's | {g['memory_2x']['met']} | "
              f"worst {g['memory_2x']['worst']} |",
              f"| resumed runs equal uninterrupted ones | {all(g['equality_after_resume'].values())} | "
              f"{g['equality_after_resume']} |",
              f"| the recommended setting costs at most 1 point on the main job (`--preset quick`) | "
              f"{g['main_job_cost_at_most_1_point']['met']} | {_main_detail(g['main_job_cost_at_most_1_point'])} |",
              "",
              "## Robust rules without attackers: final accuracy (points against the plain mean)", "",
              "| method | mean | " + " | ".join(RULES[1:]) + " |", "|---|---|" + "---|" * (len(RULES) - 1)]
    for m in methods:
        lines.append(f"| {m} | {100 * res['clean_accuracy'][m]:.1f}% | "
                     + " | ".join(f"{res['robust_cost_points'][m][r]:+.1f}" for r in RULES[1:]) + " |")
    lines += ["", "## Attacks: final accuracy (plain mean / recommended robust), uploads refused", "",
              "| attack | attackers | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for attack in ATTACKS:
        for k in ATTACKERS:
            cells = []
            for m in methods:
                a = res["runs"]["attacks"][f"{m}/{attack}/{k}/mean"]
                b = res["runs"]["attacks"][f"{m}/{attack}/{k}/recommended"]
                cells.append(f"{100 * a.get('final_accuracy', 0):.1f} / {100 * b.get('final_accuracy', 0):.1f} "
                             f"({a.get('clients_rejected', 0)})")
            lines.append(f"| {attack} | {k} | " + " | ".join(cells) + " |")
    lines += ["", "## Peak memory (ru_maxrss of a fresh process, against the honest case)", "",
              "| case | outcome | MiB | ratio |", "|---|---|---|---|"]
    for part in ("server", "loader", "data"):
        for case, r in res["memory"][part].items():
            ratio = res["memory_ratio"].get(f"{part}/{case}", 1.0)
            mib = (r["maxrss_kb"] or 0) / 1024
            lines.append(f"| {part}: {case} | {str(r['outcome'])[:70]} | {mib:.0f} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def cost_table(res: dict[str, Any]) -> str:
    """docs/robustness.md's table: each rule's cost without attackers, and the recommended setting under attack."""
    def setting(m: str) -> str:
        return res["recommended"][m]["robust.rule"]

    lines = ["| method | plain mean | " + " | ".join(RULES[1:]) + " | recommended | sign_flip x1, x3: mean / "
             "recommended |", "|---|---|" + "---|" * (len(RULES) + 1)]
    for m in METHODS:
        flips = [" / ".join(f"{100 * res['runs']['attacks'][f'{m}/sign_flip/{k}/{r}'].get('final_accuracy', 0):.1f}"
                            for r in ("mean", "recommended")) for k in ATTACKERS]
        lines.append(f"| {m} | {100 * res['clean_accuracy'][m]:.1f}% | "
                     + " | ".join(f"{res['robust_cost_points'][m][r]:+.1f}" for r in RULES[1:])
                     + f" | {setting(m)}: {res['robust_cost_points'][m]['recommended']:+.1f} | "
                     + ", ".join(flips) + " |")
    main = res["goals"]["main_job_cost_at_most_1_point"]
    lines += ["", "byzantine = 3: krum keeps 7, trimmed_mean (trim 0.2) and bulyan (too few uploads for its "
              "Krum step) trim 3 at each end; recommended: each method's rule with its screens (the table above). "
              + (f"On the main job (`--preset quick`, 12 rounds), D-Turbo-VBI's ends at "
                 f"{100 * main['accuracy']:.2f}% against {100 * main['main_job_accuracy']:.2f}% with the plain mean."
                 if main.get("accuracy") else "")]
    return "\n".join(lines) + "\n"


def _main_detail(m: dict[str, Any]) -> str:
    if m.get("accuracy") is None:
        return "not run (benchmarks/attacks_inside.py --stage main)"
    return (f"{100 * m['accuracy']:.2f}% against the main job's {100 * m['main_job_accuracy']:.2f}% "
            f"({m['cost_points']} points; attacks.json)")


def write_results(res: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hostile.json").write_text(json.dumps(res, indent=1) + "\n")
    (RESULTS / "hostile.md").write_text(markdown(res))
    (RESULTS / "hostile_cost.md").write_text(cost_table(res))
    fill_block(ROOT / "docs" / "robustness.md", "benchmarks/results/hostile_cost.md", cost_table(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "attacks")
    ap.add_argument("--stage", choices=("all", "clean", "runs", "memory", "dirs", "report"), default="all")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    runs = memory = None
    if args.stage == "clean":
        stage_runs(args, attacks=False)
    if args.stage in ("all", "runs"):
        runs = stage_runs(args)
    if args.stage == "dirs":  # the memory stage's model directories, made in a process of their own
        assert list(make_model_dirs(args.work / "memory")) == list(LOADER_CASES)
    if args.stage == "memory":
        memory = stage_memory(args)
        (args.work / "memory.json").write_text(json.dumps(memory))
    if args.stage == "all":  # measured from a fresh, small process (a child's ru_maxrss starts at its parent's peak)
        subprocess.run([sys.executable, __file__, "--stage", "memory", "--work", str(args.work),
                        "--rounds", str(args.rounds)], check=True)
    if args.stage not in ("all", "report"):
        return
    runs = runs or json.loads((args.work / "runs.json").read_text())
    memory = memory or json.loads((args.work / "memory.json").read_text())
    seconds = sum(v.get("seconds", 0.0) for part in ("clean", "attacks") for v in runs[part].values())
    seconds += memory.get("seconds", 0.0)
    res = report(runs, memory, args, seconds)
    write_results(res)
    print(markdown(res))
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB")


if __name__ == "__main__":
    main()

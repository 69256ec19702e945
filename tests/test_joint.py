"""The joint comparison's harness and report (benchmarks/harness.py, benchmarks/joint.py) on hand-made runs: the
choice on validation, T, bits to T, the dominance columns and the goals against values computed by hand; the cache
of finished runs; the speed benchmark on run directories of two methods. No campaign is trained."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from run_helpers import load_benchmark

from dturbo.settings import parse_config

CAMPAIGN = """
[protocol]
seeds = [0, 1, 2]
t_margin = 0.015
references = ["fedavg32", "fedavg16"]
t_reference = "fedavg16"
budget = 6

[protocol.config]
experiment = { rounds = 3, eval_every = 1, threads = 1 }
data = { name = "fashion-mnist", validation = 0.1 }
federation = { clients = 10, partition = "dirichlet", alpha = 0.5 }
model = { name = "alexnet-small" }
train = { local_epochs = 1.0, batch_size = 64, optimizer = "adam" }

[base.dt]
"dturbo.sparsity.target_density" = 0.2

[[candidate]]
label = "fa16_a"
method = "fedavg16"
algorithm = "fedavg"
note = "a"
set = { "train.lr" = 0.001 }

[[candidate]]
label = "fa16_b"
method = "fedavg16"
algorithm = "fedavg"
note = "b"
set = { "train.lr" = 0.002 }

[[candidate]]
label = "fa32"
method = "fedavg32"
algorithm = "fedavg"
note = "c"
set = { "fedavg.dtype" = "float32" }

[[candidate]]
label = "dt_few"
method = "dturbo"
algorithm = "dturbo"
base = "dt"
note = "d"
set = { "train.lr" = 0.005 }

[[candidate]]
label = "dt_many"
method = "dturbo"
algorithm = "dturbo"
base = "dt"
note = "e"
set = { "train.lr" = 0.003 }

[[candidate]]
label = "stc_x"
method = "stc"
algorithm = "stc"
note = "f"
set = { "stc.p_up" = 0.1 }
"""

# (label, seed): test accuracy, validation accuracy, cumulative Mbit per round, final density
FAKE = {
    # FedAvg-16: fa16_a wins on validation (0.86 > 0.84) although its test accuracy is lower
    ("fa16_a", 0): ([0.50, 0.80, 0.85], [0.5, 0.80, 0.86], [20, 40, 60], 1.0),
    ("fa16_a", 1): ([0.50, 0.82, 0.87], [0.5, 0.80, 0.86], [20, 40, 60], 1.0),
    ("fa16_a", 2): ([0.50, 0.79, 0.86], [0.5, 0.80, 0.86], [20, 40, 60], 1.0),
    ("fa16_b", 0): ([0.50, 0.85, 0.88], [0.5, 0.80, 0.84], [20, 40, 60], 1.0),
    ("fa32", 0): ([0.55, 0.83, 0.87], [0.5, 0.80, 0.85], [40, 80, 120], 1.0),
    ("fa32", 1): ([0.55, 0.83, 0.88], [0.5, 0.80, 0.85], [40, 80, 120], 1.0),
    ("fa32", 2): ([0.55, 0.83, 0.89], [0.5, 0.80, 0.85], [40, 80, 120], 1.0),
    # T_val = 0.86 - 0.015 = 0.845: dt_few reaches it at 4 Mbit, dt_many at 3 Mbit but ends below it
    ("dt_few", 0): ([0.60, 0.84, 0.86], [0.6, 0.85, 0.85], [2, 4, 6], 0.2),
    ("dt_few", 1): ([0.60, 0.86, 0.86], [0.6, 0.85, 0.85], [2, 4, 6], 0.2),
    ("dt_few", 2): ([0.60, 0.84, 0.85], [0.6, 0.85, 0.85], [2, 4, 6], 0.2),
    ("dt_many", 0): ([0.85, 0.85, 0.84], [0.85, 0.84, 0.84], [3, 6, 9], 0.2),
    # STC never reaches T_val: chosen as the highest final validation accuracy, never reaches T on test
    ("stc_x", 0): ([0.60, 0.70, 0.80], [0.6, 0.7, 0.80], [1, 2, 3], 1.0),
    ("stc_x", 1): ([0.60, 0.70, 0.81], [0.6, 0.7, 0.80], [1, 2, 3], 1.0),
    ("stc_x", 2): ([0.60, 0.70, 0.79], [0.6, 0.7, 0.80], [1, 2, 3], 1.0),
}


@pytest.fixture(scope="module")
def mods() -> tuple[ModuleType, ModuleType]:
    h = load_benchmark("harness")
    return h, load_benchmark("joint")


@pytest.fixture()
def setup(tmp_path, mods):
    h, j = mods
    path = tmp_path / "toyjoint.toml"
    path.write_text(CAMPAIGN)
    camp = h.load_campaign(path)
    s = h.Settings(results=tmp_path / "results", runs_root=tmp_path / "runs", data_path="/nowhere")
    out = s.results / f"{camp.tag}_runs"
    out.mkdir(parents=True)
    by = camp.by_label()
    for (label, seed), (acc, val, mbit, dens) in FAKE.items():
        cfg = parse_config(h.config_tree(camp, by[label], seed, "/nowhere"))
        (out / f"{label}_s{seed}.toml").write_text(cfg.to_toml())
        lines = ["round,accuracy,val_accuracy,density,up_bits,down_bits,cum_bits,participants"]
        for r in range(3):
            lines.append(f"{r + 1},{acc[r]},{val[r]},{dens},{mbit[0] * 1e6 / 4},{mbit[0] * 3e6 / 4},"
                         f"{mbit[r] * 1e6},10")
        (out / f"{label}_s{seed}.csv").write_text("\n".join(lines) + "\n")
    return h, j, camp, s


def test_choice_uses_validation_only(setup):
    h, j, camp, s = setup
    choice = j.choose(camp, h.load_runs(camp, s))
    assert choice.chosen["fedavg16"] == "fa16_a"  # validation, not test
    assert choice.t_val == pytest.approx(0.86 - 0.015)
    assert choice.chosen["dturbo"] == "dt_few"  # dt_many reaches T_val sooner but ends below it
    assert choice.chosen["stc"] == "stc_x"
    assert "fewest bits" in choice.why["dturbo"] and "no candidate" in choice.why["stc"]


def test_summary_bits_to_t_dominance_and_goals(setup):
    h, j, camp, s = setup
    runs = h.load_runs(camp, s)
    speed = {"dt_few_s0": 2.2, "dt_few_s1": 2.0, "dt_few_s2": 2.1,
             **{f"{x}_s{k}": 1.0 for x in ("fa16_a", "fa32", "stc_x") for k in range(3)}}
    res = j.summarize(camp, runs, speed)
    t = np.mean([0.85, 0.87, 0.86]) - 0.015  # FedAvg-16's chosen test accuracy over seeds, less 1.5 points
    assert res["t"] == pytest.approx(t)
    rows = {r["method"]: r for r in res["table"]}
    # by hand: dt_few reaches t = 0.845 in rounds 3, 2, 3 (0.84 < t in round 2 of seeds 0 and 2): 6, 4, 6 Mbit
    assert rows["dturbo"]["bits_to_t_seeds"] == [6e6, 4e6, 6e6]
    assert rows["dturbo"]["bits_to_t"] == pytest.approx(16e6 / 3)
    assert rows["fedavg16"]["bits_to_t"] == pytest.approx(60e6)  # rounds 3, 3, 3
    assert rows["stc"]["bits_to_t"] is None and rows["stc"]["seeds_reaching_t"] == 0
    assert rows["dturbo"]["speedup"] == pytest.approx(2.1)
    # round 1's downlink: three quarters of round 1's Mbit (dt_few 2, fa16_a 20); bits to T after it, by hand
    assert rows["dturbo"]["initial_bits"] == pytest.approx(1.5e6)
    assert rows["dturbo"]["bits_to_t_after_initial"] == pytest.approx((4.5e6 + 2.5e6 + 4.5e6) / 3)
    assert rows["fedavg16"]["bits_to_t_after_initial"] == pytest.approx(45e6)
    assert rows["stc"]["bits_to_t_after_initial"] is None
    # bits per parameter per round: up = a quarter of round 1's Mbit over 10 clients
    n = j.params("alexnet-small", "fashion-mnist")
    assert rows["dturbo"]["up_bits_per_param"] == pytest.approx(0.5e6 / (10 * n))
    goal = {g["goal"]: g for g in res["goals"]}
    assert goal["every seed reaches T"]["met"]  # 3 of 3
    # STC never reaches T: no ratio, missed; STC's accuracy 0.80 against 0.857: met
    assert goal["bits to T at most 0.7x STC's"]["ratio"] is None and not goal["bits to T at most 0.7x STC's"]["met"]
    assert goal["final test accuracy at least STC's - 0.3 points"]["met"]
    gap = 100 * (np.mean([0.87, 0.88, 0.89]) - np.mean([0.86, 0.86, 0.85]))  # 2.33 points below FedAvg 32-bit
    fa32 = goal["final test accuracy within 1.0 point of FedAvg 32-bit"]
    assert fa32["value"] == f"{gap:+.2f} points below" and not fa32["met"]
    assert not goal["exported model at least 2.5x faster than dense (CPU)"]["met"]  # 2.1x
    # the curves: lowest 0.60 (>= 15%): met; rounds after 3: none in a 3-round run, no drop
    assert goal["every round of every seed at least 5 points above chance (10%)"]["value"] == "lowest 60.0%"
    assert goal["no round after round 3 more than 3 points below the round before"]["met"]
    stc = goal["better than STC on at least 2 of accuracy, bits to T and speedup"]
    # accuracy 0.857 > 0.80, reaches T where STC never does, 2.1x > 1.0x: all three
    assert stc["axes"] == {"accuracy": True, "bits_to_t": True, "speedup": True} and stc["met"]
    fa16 = goal["better than FedAvg 16-bit on at least 2 of accuracy, bits to T and speedup"]
    assert fa16["axes"] == {"accuracy": False, "bits_to_t": True, "speedup": True} and fa16["met"]
    # the results file's runs, as the schema has them
    one = res["runs"][0]
    assert set(one) >= {"method", "label", "seed", "final_density", "speedup", "curve"}
    assert one["curve"][0] == [1, pytest.approx(one["curve"][0][1]), pytest.approx(one["curve"][0][2])]
    text = j.markdown(res)
    assert "D-Turbo-VBI" in text and "**missed**" in text and "**met**" in text
    assert "| D-Turbo-VBI | 1.50 | 3.8 |  |" in text  # no ratio: STC never reaches T


def test_the_curve_goals_find_a_round_at_chance_and_a_drop_by_hand(mods):
    _, j = mods
    row = {"seeds": [0, 1], "seeds_reaching_t": 2, "speedup": 3.0, "bits_to_t": 1.0, "accuracy": 0.9}
    curves = [np.array([0.10, 0.50, 0.70, 0.80, 0.76, 0.81]), np.array([0.30, 0.60, 0.70, 0.72, 0.71, 0.68])]
    goal = {g["goal"]: g for g in j.goals({"dturbo": row}, curves)}
    chance = goal["every round of every seed at least 5 points above chance (10%)"]
    assert chance["value"] == "lowest 10.0%" and not chance["met"]
    # after round 3: drops of 4 (0.80 -> 0.76) and 3 points (0.71 -> 0.68); 0.80 -> 0.76 is the largest
    drop = goal["no round after round 3 more than 3 points below the round before"]
    assert drop["value"] == "largest drop 4.0 points" and not drop["met"]
    assert goal["no round after round 3 more than 3 points below the round before"]["met"] is False
    curves[0][4] = 0.775  # 2.5 points, and 3.0 on the other seed: met
    assert {g["goal"]: g for g in j.goals({"dturbo": row}, curves)}[
        "no round after round 3 more than 3 points below the round before"]["met"]


def test_axes_count_never_reaching_t_as_worse(mods):
    _, j = mods
    a = {"accuracy": 0.8, "bits_to_t": None, "speedup": 1.0}
    b = {"accuracy": 0.7, "bits_to_t": 5e6, "speedup": 1.0}
    assert j.axes(a, b) == {"accuracy": True, "bits_to_t": False, "speedup": False}
    assert j.axes(b, a)["bits_to_t"] is True
    assert j.axes(a, {**b, "bits_to_t": None})["bits_to_t"] is False  # neither reaches T: no win
    # speedup: with the seeds' timings, a win needs every seed faster than every one of the other's
    fast = {**a, "speedup": 2.52, "speedup_seeds": [2.52, 2.49, 2.54]}
    same = {**b, "speedup": 2.54, "speedup_seeds": [2.54, 2.54, 2.53]}
    assert j.axes(fast, same)["speedup"] is False and j.axes(same, fast)["speedup"] is False
    assert j.axes(fast, {**b, "speedup": 1.0, "speedup_seeds": [1.0, 1.01, 0.99]})["speedup"] is True
    assert j.axes(fast, {**b, "speedup": 2.4, "speedup_seeds": [2.4, 2.5, 2.3]})["speedup"] is False  # 2.49 < 2.5


def test_the_report_names_each_axis_a_peer_wins_with_both_numbers(mods):
    _, j = mods
    dt = {"method": "dturbo", "name": "D-Turbo-VBI", "accuracy": 0.88, "bits_to_t": 50.2e6, "speedup": 2.3}
    stc = {"method": "stc", "name": "STC", "accuracy": 0.89, "bits_to_t": 37.4e6, "speedup": 1.0}
    paq = {"method": "fedpaq", "name": "FedPAQ", "accuracy": 0.87, "bits_to_t": 150e6, "speedup": 1.0}
    wins = j.peer_wins([dt, stc, paq])
    assert wins == ["STC: higher test accuracy, 89.00% against 88.00%",
                    "STC: fewer bits to T, 37.4 Mbit; against 50.2 Mbit"]
    assert j.peer_wins([{**dt, "bits_to_t": None}, stc])[1] == (
        "STC: fewer bits to T, 37.4 Mbit; not all of D-Turbo-VBI's seeds reach T")
    assert j.peer_wins([stc, paq]) == []


def test_cache_key_ignores_names_and_data_location(mods, tmp_path):
    h, _ = mods
    path = tmp_path / "c.toml"
    path.write_text(CAMPAIGN)
    camp = h.load_campaign(path)
    cand = camp.by_label()["fa16_a"]
    a = h.config_tree(camp, cand, 0, "/a")
    b = h.config_tree(camp, cand, 0, "/b")
    b["experiment"]["name"] = "other"
    assert h.cache_key(a) == h.cache_key(b)
    assert h.cache_key(a) != h.cache_key(h.config_tree(camp, cand, 1, "/a"))  # the seed counts
    # another method's section does not count
    c = {**a, "stc": {"p_up": 0.5}}
    assert h.cache_key(a) == h.cache_key(c)


def test_a_committed_run_that_predates_a_key_is_read_with_the_value_it_ran_with(mods, tmp_path):
    """A run's config.toml written before ``[dturbo] sampling`` existed ran the local reparameterisation: its cache key
    and its loaded config say "local", whatever the default is now, so the run stays done."""
    import re

    h, _ = mods
    path = tmp_path / "c.toml"
    path.write_text(CAMPAIGN)
    camp = h.load_campaign(path)
    tree = h.config_tree(camp, camp.by_label()["dt_few"], 0, "/a")
    old = tmp_path / "dt_few_s0.toml"
    old.write_text(re.sub(r"(?m)^sampling = .*\n", "", parse_config(tree).to_toml()))
    assert "sampling" not in old.read_text()

    def sampled(name: str) -> dict:
        return {**tree, "dturbo": {**tree["dturbo"], "sampling": name}}

    assert h._toml_key(old) == h.cache_key(sampled("local")) != h.cache_key(sampled("detached"))
    assert parse_config(h.run_tree(old)).dturbo.sampling == "local"


def test_a_candidate_that_cannot_run_is_refused_before_the_campaign(mods, tmp_path):
    h, _ = mods
    path = tmp_path / "bad.toml"
    path.write_text(CAMPAIGN.replace('"dturbo.sparsity.target_density" = 0.2',
                                     '"dturbo.sparsity.target_density" = 0.05\n"dturbo.sparsity.layer_targets" = '
                                     '{ conv4 = 0.9 }'))
    with pytest.raises(h.HarnessError, match="dt_few"):
        h.load_campaign(path)


def test_speed_times_a_sparse_run_and_reads_a_dense_one_as_1x(tmp_path, make_toy):
    from dturbo.sim import Simulator

    speed = load_benchmark("speed")
    toy = make_toy(400)
    for alg in ("feddst", "fedavg"):
        cfg = parse_config({"experiment": {"name": alg, "seed": 0, "rounds": 1, "threads": 1, "algorithm": alg},
                            "data": {"name": "npz", "path": str(toy)}, "federation": {"clients": 2, "alpha": 1.0},
                            "model": {"name": "mlp", "hidden": [32]}, "train": {"local_steps": 5, "lr": 0.01},
                            "feddst": {"density": 0.3}})
        Simulator(cfg, tmp_path / alg).run()
    assert speed.zero_weights(tmp_path / "fedavg") == 0 and speed.zero_weights(tmp_path / "feddst") > 0
    out = tmp_path / "speed.json"
    assert speed.main([str(tmp_path / "feddst"), str(tmp_path / "fedavg"), "--samples", "64", "--batches", "64",
                       "--sessions", "1", "--threads", "1", "--out", str(out)]) == 0
    recs = json.loads(out.read_text())["runs"]
    assert recs[0]["timed"] and recs[0]["speedup"] > 0 and len(recs[0]["speedup_sessions"]) == 1
    assert recs[1] == {"run_dir": str(tmp_path / "fedavg"), "speedup": 1.0, "timed": False,
                       "why": "no zero weight: the final model is the dense network"}


def test_campaign_file_keeps_the_budget(mods):
    h, _ = mods
    camp = h.load_campaign(Path(__file__).resolve().parents[1] / "benchmarks" / "joint.toml")
    counts = {m: sum(c.method == m for c in camp.candidates) for m in camp.methods()}
    assert set(counts) == {"fedavg16", "fedavg32", "fedpaq", "stc", "feddst", "dturbo", "dssm", "fedpm",
                           "narrow_fedavg16", "narrow_stc"}
    assert all(n <= camp.protocol["budget"] for n in counts.values())


def test_narrow_baselines_train_the_exported_architecture_and_are_timed(mods):
    """The dense-from-scratch rows: D-Turbo-VBI's exported architecture (seed 0's export, committed) in
    model.widths, timed against the protocol's network dense (not 1.0x by definition as full-size FedAvg and STC)."""
    h, joint = mods
    root = Path(__file__).resolve().parents[1]
    camp = h.load_campaign(root / "benchmarks" / "joint.toml")
    chosen = json.loads((root / "benchmarks" / "results" / "joint.json").read_text())["chosen"]["dturbo"]
    export = json.loads((root / "benchmarks" / "results" / "joint_models" / f"{chosen}_s0" / "exported" /
                         "model.json").read_text())
    widths = [op.get("out_channels", op.get("out_features")) for op in export["ops"]
              if op["type"] in ("conv2d", "linear")][:-1]
    narrow = [c for c in camp.candidates if c.method.startswith("narrow_")]
    assert narrow and all(c.overrides["model.widths"] == widths for c in narrow)
    assert all(joint.narrow(c) and not joint.dense_final(c) for c in narrow)
    assert joint.dense_final(camp.by_label()["fedavg16_lr3e-3_cos"]) and not joint.dense_final(camp.by_label()[chosen])


def test_verify_trains_the_first_rounds_again_and_finds_a_changed_value(mods, tmp_path, make_toy):
    h, _ = mods
    toy = make_toy(200)
    path = tmp_path / "tiny.toml"
    path.write_text(f"""
[protocol]
seeds = [0]
[protocol.config]
experiment = {{ rounds = 3, threads = 1 }}
data = {{ name = "npz", path = "{toy}" }}
federation = {{ clients = 2, partition = "iid" }}
model = {{ name = "mlp", hidden = [8] }}
train = {{ local_steps = 3 }}

[[candidate]]
label = "fa"
method = "fedavg16"
algorithm = "fedavg"
note = "n"
""")
    camp = h.load_campaign(path)
    s = h.Settings(results=tmp_path / "results", runs_root=tmp_path / "runs", data_path=str(toy))
    job = h.plan(h.Job(camp, camp.candidates[0], 0, s))
    assert job.status == "todo"
    from dturbo.settings import parse_config
    from dturbo.sim import Simulator

    Simulator(parse_config(job.tree), tmp_path / "ran").run()
    committed = tmp_path / "fa_s0.csv"
    committed.write_text((tmp_path / "ran" / "metrics.csv").read_text())
    assert h.verify(job, committed, rounds=2) == []
    lines = committed.read_text().splitlines()
    head, first = lines[0].split(","), lines[1].split(",")
    first[head.index("cum_bits")] = "1"
    committed.write_text("\n".join([lines[0], ",".join(first), *lines[2:]]) + "\n")
    diffs = h.verify(job, committed, rounds=2)
    assert len(diffs) == 2 and diffs[0].startswith("cum_bits")
    assert diffs[1].endswith("trained on a machine its files do not name")  # committed without environment.jsonl
    # with it, the difference names both machines: the same code rounds differently on other vector instructions
    (tmp_path / "fa_s0.environment.jsonl").write_text((tmp_path / "ran" / "environment.jsonl").read_text())
    here = h.machine()
    assert h.verify(job, committed, rounds=2)[1] == (
        f"verified on {here['cpu']} ({here['cpu_capability']}, torch {here['torch']}); trained on {here['cpu']} "
        f"({here['cpu_capability']}, torch {here['torch']})")


def test_a_label_with_dots_is_committed_under_its_whole_name(mods, tmp_path):
    """lr1.5e-3: the committed csv and toml keep the whole run name (a suffix swap would cut it at the first dot)."""
    h, _ = mods
    path = tmp_path / "c.toml"
    path.write_text(CAMPAIGN.replace('label = "fa16_b"', 'label = "fa16_lr1.5e-3"'))
    camp = h.load_campaign(path)
    s = h.Settings(results=tmp_path / "results", runs_root=tmp_path / "runs")
    src = tmp_path / "elsewhere" / "old_s0.csv"
    src.parent.mkdir()
    src.write_text("round,accuracy\n1,0.5\n")
    src.with_suffix(".toml").write_text("[experiment]\n")
    job = h.Job(camp, camp.by_label()["fa16_lr1.5e-3"], 0, s, status="reuse", source=src)
    assert h.execute(job)
    assert sorted(p.name for p in job.committed.iterdir()) == ["fa16_lr1.5e-3_s0.csv", "fa16_lr1.5e-3_s0.toml"]
    # a run whose machine is recorded takes its environment along
    (tmp_path / "elsewhere" / "old_s0.environment.jsonl").write_text('{"first_round": 0}\n')
    assert h.execute(job)
    assert (job.committed / "fa16_lr1.5e-3_s0.environment.jsonl").read_text() == '{"first_round": 0}\n'


@pytest.fixture()
def planned(setup):
    """(the harness, the campaign, its settings, fa16_b seed 1 planned as todo: nothing of it exists yet)."""
    h, _, camp, s = setup
    job = h.plan(h.Job(camp, camp.by_label()["fa16_b"], 1, s))
    assert job.status == "todo"
    return h, camp, s, job


def test_a_run_another_process_finished_since_the_plan_is_copied_not_run_again(planned):
    """Two campaign processes share the run folders: a job planned as todo whose run another process has finished
    by the time it starts is copied, and the finished run folder is kept (it was removed and trained again)."""
    h, camp, s, job = planned
    job.run_dir.mkdir(parents=True)  # the other process's run, finished
    (job.run_dir / "config.toml").write_text(parse_config(job.tree).to_toml())
    rows = "".join(f"{r},0.5,0.5,1.0,1,1,{r},10\n" for r in range(1, job.rounds + 1))
    (job.run_dir / "metrics.csv").write_text("round,accuracy,val_accuracy,density,up_bits,down_bits,cum_bits,"
                                             "participants\n" + rows)
    (job.run_dir / "model.safetensors").write_bytes(b"x")
    assert h.execute(job)
    assert (job.run_dir / "model.safetensors").exists()
    assert (job.committed / f"{job.name}.csv").read_text() == (job.run_dir / "metrics.csv").read_text()


def test_a_run_of_another_config_started_since_the_plan_is_left_alone(planned):
    """A job planned as todo whose folder another process has since filled with a run of another config is skipped,
    the folder untouched (it is neither removed nor copied as this job's)."""
    h, camp, s, job = planned
    job.run_dir.mkdir(parents=True)
    other = h.plan(h.Job(camp, camp.by_label()["fa16_a"], 1, s))
    (job.run_dir / "config.toml").write_text(parse_config(other.tree).to_toml())
    assert not h.execute(job)
    assert (job.run_dir / "config.toml").exists() and not (job.committed / f"{job.name}.csv").exists()

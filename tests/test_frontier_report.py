"""The frontier benchmark's report (benchmarks/frontier.py) from hand-made metrics files: no training."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from run_helpers import load_benchmark

ROUNDS = 3


@pytest.fixture(scope="module")
def fr() -> ModuleType:
    return load_benchmark("frontier")


# (label, seed): test accuracy, validation accuracy, cumulative bits (Mbit), final density, up / down bits a
# parameter a round (per client).
FAKE = {
    ("dturbo_base", 0): ([0.60, 0.795, 0.81], [0.6, 0.80, 0.82], [2, 4, 6], 0.12, 0.5, 1.5),
    ("dturbo_base", 1): ([0.60, 0.70, 0.80], [0.6, 0.70, 0.80], [2, 4, 6], 0.12, 0.5, 1.5),
    ("dturbo_base", 2): ([0.80, 0.82, 0.83], [0.8, 0.82, 0.83], [2, 4, 6], 0.12, 0.5, 1.5),
    # higher validation accuracy, but 30% nonzero: D-Turbo-VBI's selection must skip it
    ("dturbo_up8", 0): ([0.70, 0.85, 0.86], [0.7, 0.85, 0.90], [3, 6, 9], 0.30, 1.0, 2.0),
    # FedAvg-16: lr 1e-3 wins on validation although its test accuracy is lower
    ("fedavg16_lr1e-3", 0): ([0.50, 0.70, 0.80], [0.5, 0.7, 0.85], [10, 20, 30], 1.0, 16.0, 16.0),
    ("fedavg16_lr2e-3", 0): ([0.50, 0.80, 0.84], [0.5, 0.7, 0.80], [10, 20, 30], 1.0, 16.0, 16.0),
    ("fedavg32_lr2e-3", 0): ([0.55, 0.80, 0.82], [0.5, 0.8, 0.82], [20, 40, 60], 1.0, 32.0, 32.0),
}


def write_fake(fr: ModuleType, settings: object, fake: dict = FAKE) -> int:
    """The committed files (csv + toml) of ``fake``'s runs; returns the model's parameter count."""
    params = fr.model_params("alexnet-small", "fashion-mnist")
    out = settings.runs_csv
    out.mkdir(parents=True, exist_ok=True)
    for (label, seed), (acc, val, mbit, dens, up, down) in fake.items():
        cfg = fr.parse_config(fr.config_dict(fr.BY_LABEL[label], seed, settings))
        (out / f"{label}_s{seed}.toml").write_text(cfg.to_toml())
        lines = ["round,accuracy,loss,val_accuracy,density,up_bits,down_bits,cum_bits,participants"]
        for r in range(settings.n_rounds):
            lines.append(f"{r + 1},{acc[r]},1.0,{val[r]},{dens},{up * 10 * params},{down * 10 * params},"
                         f"{mbit[r] * 1e6},10")
        (out / f"{label}_s{seed}.csv").write_text("\n".join(lines) + "\n")
    return params


def test_report_from_files(fr: ModuleType, tmp_path: Path) -> None:
    s = fr.Settings(runs_root=tmp_path / "runs", results=tmp_path / "results", docs=tmp_path / "docs",
                    rounds=ROUNDS)
    params = write_fake(fr, s)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text("# Results\n\nolder text\n")
    fr.report(s, "val_accuracy")
    doc_path = tmp_path / "docs" / "results.md"
    fr.replace_section(doc_path, (s.results / "frontier.md").read_text().split("\n", 2)[2])  # replaced, not added

    data = json.loads((s.results / "frontier.json").read_text())
    assert set(data) >= {"protocol", "runs"}
    assert data["protocol"]["validation"] == 0.1 and data["protocol"]["threads"] == 1
    assert data["protocol"]["params"] == params
    assert len(data["runs"]) == len(FAKE)
    for run in data["runs"]:
        assert {"method", "label", "seed", "final_density", "curve"} <= set(run)
        assert isinstance(run["seed"], int) and 0 <= run["final_density"] <= 1
        assert [p[0] for p in run["curve"]] == [1, 2, 3]
        assert all(isinstance(p[0], int) and 0 <= p[2] <= 1 for p in run["curve"])
        assert all(a[1] < b[1] for a, b in zip(run["curve"], run["curve"][1:], strict=False))
    labels = {(r["label"], r["seed"]): r for r in data["runs"]}
    # The chosen settings carry the labels; the others keep their own.
    assert labels[("dturbo", 0)]["setting"] == "dturbo_base" and labels[("dturbo", 0)]["method"] == "dturbo"
    assert ("dturbo_up8", 0) in labels  # better on validation, but over 15% nonzero
    assert labels[("fedavg16", 0)]["setting"] == "fedavg16_lr1e-3"  # chosen on validation, not test
    assert ("fedavg16_lr2e-3", 0) in labels and ("fedavg32", 0) in labels
    assert labels[("dturbo", 0)]["curve"][1] == [2, 4e6, 0.795]

    # Bits to reach, by hand. T = FedAvg-16's final test accuracy - 1 point = 0.80 - 0.01 = 0.79.
    # D-Turbo-VBI: seed 0 reaches 0.79 at round 2 (4 Mbit), seed 1 at round 3 (6), seed 2 at round 1 (2): mean 4.
    # FedAvg-16 (lr 1e-3): round 3, 30 Mbit; FedAvg-32: round 2, 40 Mbit.
    checks = data["checks"]
    assert data["protocol"]["target_T"] == pytest.approx(0.79)
    assert checks["bits_ratio_vs_fedavg16"] == pytest.approx(4 / 30)
    assert checks["bits_ratio_vs_others"]["fedavg32"] == pytest.approx(4 / 40)
    # Seed by seed: D-Turbo-VBI's seed 0 (4 Mbit) against FedAvg's seed 0; FedAvg has no seeds 1, 2 here.
    by_seed = checks["bits_ratio_to_T_by_seed"]
    assert by_seed["fedavg16"]["0"] == pytest.approx(4 / 30) and by_seed["fedavg32"]["0"] == pytest.approx(4 / 40)
    assert by_seed["fedavg16"]["1"] is None and by_seed["fedavg16"]["2"] is None
    assert checks["accuracy_gap_points"] == pytest.approx(100 * (0.82 - (0.81 + 0.80 + 0.83) / 3))
    assert checks["steady_bits_per_param"]["up"] == pytest.approx(0.5)
    assert checks["steady_bits_per_param"]["mean"] == pytest.approx(1.0)
    runs = fr.load_runs(s, ROUNDS)
    line = fr.build_lines(runs, fr.select(runs))["dturbo"]
    assert line.bits_to(0.79) == pytest.approx(4e6)
    assert line.bits_to(0.80) == pytest.approx((6 + 6 + 2) / 3 * 1e6)  # seed 1 reaches 0.80 exactly at round 3
    assert line.bits_to(0.85) is None and line.reached(0.85) == "0/3"

    md = (s.results / "frontier.md").read_text()
    assert "| D-Turbo-VBI | `dturbo_base` | 3 | 81.33 ± 1.53 | 12.0 | 4.0 | 4.7 | never (0/3) |" in md
    assert "| FedAvg 16-bit | `fedavg16_lr1e-3` | 1 | 80.00 | 100.0 | 30.0 |" in md
    assert "| FedAvg 32-bit | `fedavg32_lr2e-3` | 1 | 82.00 | 100.0 | 40.0 |" in md
    assert "| `dturbo_up8` | up 8 bits | 90.00 | 86.00 | 30.0 | 9.0 | 1.000 | 2.000 |" in md
    assert "| FedAvg 16-bit | `fedavg16_lr1e-3` **chosen** |" in md
    assert "FedAvg 16-bit seed 0 0.133, seed 1 n/a, seed 2 n/a" in md
    assert md.count("**pass**") == 4  # accuracy and density, 1/5 of FedAvg-16, 1/2 of the others, bits/param
    # Only FedAvg 32-bit ends above D-Turbo-VBI's mean 81.33%, with 60 Mbit against 6.
    assert "- Final accuracy above D-Turbo-VBI's 81.33%: FedAvg 32-bit 82.00% (+0.67 points, 10.0x its bits" in md

    doc = doc_path.read_text()
    assert doc.startswith("# Results\n\n<!-- frontier:start -->\n## Accuracy vs bits: the frontier\n")
    assert doc.count("<!-- frontier:start -->") == 1 and doc.count("<!-- frontier:end -->") == 1
    assert doc.rstrip().endswith("older text")
    assert (tmp_path / "docs" / "results" / "frontier.png").stat().st_size > 0
    assert "](../docs/results/frontier.png)" in md


def test_plan_reuses_committed_runs(fr: ModuleType, tmp_path: Path) -> None:
    """A run whose committed csv is complete (same config) is not run again; a shorter one is."""
    s = fr.Settings(runs_root=tmp_path / "runs", results=tmp_path / "results", docs=tmp_path / "docs",
                    rounds=ROUNDS)
    write_fake(fr, s)
    assert fr.plan_job(fr.BY_LABEL["fedavg32_lr2e-3"], 0, s).status == "done"
    longer = fr.Settings(runs_root=s.runs_root, results=s.results, docs=s.docs, rounds=ROUNDS + 1)
    job = fr.plan_job(fr.BY_LABEL["fedavg32_lr2e-3"], 0, longer)
    assert job.status == "todo" and job.rounds_left == ROUNDS + 1
    assert fr.makespan([3.0, 3.0, 2.0, 2.0], 2) == 5.0  # longest first, as run_jobs orders them


def test_a_validation_tie_goes_to_fewer_bits_then_to_the_lower_validation_loss(fr: ModuleType) -> None:
    from types import SimpleNamespace

    def run(label: str, val: float, bits: float, val_loss: float) -> SimpleNamespace:
        cand = SimpleNamespace(label=label, line="fedavg32", note="")
        return SimpleNamespace(seed=0, cand=cand, density=1.0, total_bits=bits,
                               m={"val_accuracy": [0.5, val], "val_loss": [1.0, val_loss]})

    runs = [run("a", 0.89, 10.0, 0.30), run("b", 0.89, 10.0, 0.28), run("c", 0.88, 1.0, 0.10)]
    assert fr.select(runs).chosen["fedavg32"] == "b"  # same accuracy and bits: the lower loss
    runs.append(run("d", 0.89, 9.0, 0.35))
    assert fr.select(runs).chosen["fedavg32"] == "d"  # same accuracy: fewer bits first


def test_a_longer_horizon_reruns_the_best_settings_and_chooses_among_them_again(fr: ModuleType,
                                                                               tmp_path: Path) -> None:
    """--horizon: each line's chosen setting and its runners-up within HORIZON_MARGIN on validation, seed 0, own
    files; chosen again on validation at the horizon; then the seeds of what it chose. A setting further behind
    is never run, even where it would win."""
    base = fr.Settings(runs_root=tmp_path / "runs", results=tmp_path / "results", docs=tmp_path / "docs",
                       rounds=ROUNDS)
    write_fake(fr, base)
    # 0.2 validation points behind FedAvg 32-bit's chosen 0.82: a runner-up within the margin
    write_fake(fr, base, {("fedavg32_lr1e-3", 0): ([0.5, 0.6, 0.81], [0.5, 0.6, 0.818], [20, 40, 60], 1.0, 32, 32)})
    longer = ROUNDS + 2
    s = fr.Settings(runs_root=tmp_path / "runs_h", results=base.results, docs=base.docs, rounds=ROUNDS,
                    horizon=longer)
    assert s.tag == f"frontier{longer}" and s.n_rounds == longer and s.selection.n_rounds == ROUNDS
    assert s.runs_csv == base.results / f"frontier{longer}_runs"

    plan = fr.horizon_plan(s, "val_accuracy")
    assert plan.candidates == {"dturbo": ["dturbo_base"], "fedavg32": ["fedavg32_lr2e-3", "fedavg32_lr1e-3"],
                               "fedavg16": ["fedavg16_lr1e-3"]}  # dturbo_up8: 30% nonzero; fedavg16_lr2e-3: 5 behind
    planned = fr.horizon_jobs(s, "val_accuracy")[0]  # seed 0 first: nothing to choose from yet
    assert [j.name for j in planned] == ["dturbo_base_s0", "fedavg32_lr2e-3_s0", "fedavg32_lr1e-3_s0",
                                         "fedavg16_lr1e-3_s0"]
    assert all(j.want["experiment"]["rounds"] == longer and j.status == "todo" for j in planned)

    grow = [0.5, 0.6, 0.7, 0.8, 0.9]
    horizon_fake = {
        ("dturbo_base", 0): (grow, grow, [1, 2, 3, 4, 5], 0.12, 0.5, 1.5),
        ("dturbo_base", 1): (grow, grow, [1, 2, 3, 4, 5], 0.12, 0.5, 1.5),
        ("fedavg16_lr1e-3", 0): ([0.5, 0.6, 0.7, 0.8, 0.85], grow, [10, 20, 30, 40, 50], 1.0, 16.0, 16.0),
        ("fedavg32_lr2e-3", 0): ([0.5, 0.6, 0.7, 0.8, 0.86], grow, [20, 40, 60, 80, 100], 1.0, 32.0, 32.0),
        # the runner-up wins at the horizon, on validation
        ("fedavg32_lr1e-3", 0): ([0.5, 0.6, 0.7, 0.8, 0.87], [*grow[:4], 0.95], [20, 40, 60, 80, 100], 1.0, 32, 32),
        # not a candidate: never part of the horizon, whatever its validation accuracy
        ("fedavg16_lr2e-3", 0): ([0.5, 0.6, 0.7, 0.8, 0.95], [0.99] * 5, [10, 20, 30, 40, 50], 1.0, 16.0, 16.0),
    }
    write_fake(fr, s, horizon_fake)
    jobs = {j.name: j.status for j in fr.horizon_jobs(s, "val_accuracy")[0]}
    assert jobs == {"dturbo_base_s0": "done", "fedavg32_lr2e-3_s0": "done", "fedavg32_lr1e-3_s0": "done",
                    "fedavg16_lr1e-3_s0": "done", "dturbo_base_s1": "done", "dturbo_base_s2": "todo",
                    "fedavg32_lr1e-3_s1": "todo", "fedavg32_lr1e-3_s2": "todo", "fedavg16_lr1e-3_s1": "todo",
                    "fedavg16_lr1e-3_s2": "todo"}

    fr.report(base, "val_accuracy")
    out = fr.report(s, "val_accuracy")
    assert out["chosen"] == {"dturbo": "dturbo_base", "fedavg32": "fedavg32_lr1e-3", "fedavg16": "fedavg16_lr1e-3"}
    assert {(r["setting"], r["seed"]) for r in out["runs"]} == {
        ("dturbo_base", 0), ("dturbo_base", 1), ("fedavg16_lr1e-3", 0), ("fedavg32_lr1e-3", 0),
        ("fedavg32_lr2e-3", 0)}
    assert out["protocol"]["rounds"] == longer and out["protocol"]["settings_chosen_at_rounds"] == ROUNDS
    assert out["protocol"]["target_T"] == pytest.approx(0.84)  # FedAvg-16's (lr 1e-3) 0.85 - 1 point
    assert out["checks"]["accuracy_gap_points"] == pytest.approx(100 * (0.87 - 0.9))  # against the re-chosen
    # T = 0.84 at round 5 for every line: 5 Mbit (D-Turbo-VBI) / 50 (FedAvg-16)
    assert out["checks"]["bits_ratio_vs_fedavg16"] == pytest.approx(5 / 50)
    md = (s.results / f"frontier{longer}.md").read_text()
    assert "**5 rounds** (not the protocol's 3)" in md and "final validation accuracy at 5 rounds, 1 local epoch)" in md
    assert "| FedAvg 32-bit | `fedavg32_lr1e-3` **chosen** |" in md and "fedavg16_lr2e-3" not in md
    assert "seed runs still missing: `dturbo_base_s2`, `fedavg32_lr1e-3_s1`" in md
    assert "](../docs/results/frontier5.png)" in md and (base.docs / "results" / "frontier5.png").exists()
    doc = (base.docs / "results.md").read_text()
    for tag in ("frontier", f"frontier{longer}"):
        assert doc.count(f"<!-- {tag}:start -->") == 1 and doc.count(f"<!-- {tag}:end -->") == 1
    assert json.loads((base.results / "frontier.json").read_text())["protocol"]["rounds"] == ROUNDS  # untouched


def test_more_local_work_reruns_the_best_settings_with_more_epochs_in_their_own_files(fr: ModuleType,
                                                                                     tmp_path: Path) -> None:
    """--local-epochs: the plan of a longer horizon (the protocol's choice and its runners-up), at the protocol's
    rounds with more local epochs a round for every method, into frontier_eE files; the protocol's untouched."""
    base = fr.Settings(runs_root=tmp_path / "runs", results=tmp_path / "results", docs=tmp_path / "docs",
                       rounds=ROUNDS)
    write_fake(fr, base)
    s = fr.Settings(runs_root=tmp_path / "runs_e", results=base.results, docs=base.docs, rounds=ROUNDS,
                    local_epochs=2)
    assert s.variant and not base.variant and s.tag == "frontier_e2" and s.flags == "--local-epochs 2"
    assert fr.Settings(horizon=30, local_epochs=3).tag == "frontier30_e3"
    assert s.selection.runs_csv == base.runs_csv and s.n_rounds == ROUNDS and s.n_epochs == 2
    planned = fr.horizon_jobs(s, "val_accuracy")[0]
    assert [j.name for j in planned] == ["dturbo_base_s0", "fedavg32_lr2e-3_s0", "fedavg16_lr1e-3_s0"]
    for j in planned:  # the only difference from the protocol's run: the local epochs
        protocol = fr.resolved(fr.config_dict(j.cand, j.seed, base))
        assert j.want["train"]["local_epochs"] == 2 and protocol["train"]["local_epochs"] == 1
        j.want["train"]["local_epochs"] = 1
        assert j.want == protocol

    grow = [0.5, 0.7, 0.9]
    write_fake(fr, s, {(lab, seed): (grow, grow, [1, 2, 3], dens, 1.0, 1.0) for lab, seed, dens in
                       (("dturbo_base", 0, 0.12), ("fedavg32_lr2e-3", 0, 1.0), ("fedavg16_lr1e-3", 0, 1.0))})
    fr.report(base, "val_accuracy")
    out = fr.report(s, "val_accuracy")
    assert out["protocol"]["local_epochs"] == 2 and out["protocol"]["rounds"] == ROUNDS
    md = (s.results / "frontier_e2.md").read_text()
    assert md.startswith("# Accuracy vs bits over 3 rounds, 2 local epochs a round: the frontier's best settings, "
                         "more local work")
    assert "`python benchmarks/frontier.py --local-epochs 2`" in md
    assert "**2 local epochs** (not the protocol's 1)" in md
    assert "with 2 local epochs a round" in md and "final validation accuracy at 3 rounds, 2 local epochs)" in md
    assert json.loads((base.results / "frontier.json").read_text())["protocol"]["local_epochs"] == 1
    doc = (base.docs / "results.md").read_text()
    assert doc.count("<!-- frontier_e2:start -->") == 1 and doc.count("<!-- frontier:start -->") == 1


def test_a_variant_s_own_candidates_join_its_plan_only(fr: ModuleType, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """VARIANT_CANDIDATES[tag]: run (seed 0) and chosen among in that variant only, after the protocol's choices;
    never planned on the protocol; named in the variant's report."""
    base = fr.Settings(runs_root=tmp_path / "runs", results=tmp_path / "results", docs=tmp_path / "docs",
                       rounds=ROUNDS)
    write_fake(fr, base)
    own = fr.Candidate("dturbo_own", "dturbo", "dturbo", {**fr.DT_BASE, "dturbo.sparsity.warmup_rounds": 1},
                       "one warm-up round")
    monkeypatch.setattr(fr, "VARIANT_CANDIDATES", {"frontier_e2": [own]})
    monkeypatch.setattr(fr, "VARIANT_WHY", {"frontier_e2": "Why: a test."})
    monkeypatch.setitem(fr.BY_LABEL, own.label, own)
    s = fr.Settings(runs_root=tmp_path / "runs_e", results=base.results, docs=base.docs, rounds=ROUNDS,
                    local_epochs=2)
    assert "dturbo_own" not in {j.cand.label for j in fr.select_jobs(base, None)}
    assert fr.horizon_plan(s, "val_accuracy").candidates["dturbo"] == ["dturbo_base", "dturbo_own"]
    grow = [0.5, 0.7, 0.9]
    write_fake(fr, s, {(lab, 0): (grow, val, [1, 2, 3], dens, 1.0, 1.0) for lab, val, dens in
                       (("dturbo_base", grow, 0.12), ("dturbo_own", [0.5, 0.7, 0.95], 0.12),
                        ("fedavg32_lr2e-3", grow, 1.0), ("fedavg16_lr1e-3", grow, 1.0))})
    jobs = [j.name for j in fr.horizon_jobs(s, "val_accuracy")[0] if j.status == "todo"]
    assert jobs[:2] == ["dturbo_own_s1", "dturbo_own_s2"]  # chosen on validation: its seeds next
    fr.report(base, "val_accuracy")
    out = fr.report(s, "val_accuracy")
    assert out["chosen"]["dturbo"] == "dturbo_own" and "dturbo_own" in out["candidates"]
    md = (s.results / "frontier_e2.md").read_text()
    assert "Candidates of this variant only, never run on the protocol" in md and "`dturbo_own` (one warm-up" in md
    assert "Why: a test." in md


def test_a_variant_with_finalists_chooses_on_the_mean_over_seeds(fr: ModuleType, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """VARIANT_FINALISTS[tag]: every candidate within the margin of the seed-0 leader gets seeds 1 and 2, and the
    best mean final validation accuracy over the 3 seeds is chosen; until the seeds are in, the leader stands and
    the report says which finalists are pending. A candidate outside the margin gets no seeds."""
    base = fr.Settings(runs_root=tmp_path / "runs", results=tmp_path / "results", docs=tmp_path / "docs",
                       rounds=ROUNDS)
    write_fake(fr, base)
    own = [fr.Candidate(f"dturbo_own{i}", "dturbo", "dturbo", {**fr.DT_BASE, "dturbo.sparsity.warmup_rounds": i},
                        f"{i} warm-up rounds") for i in (1, 3)]
    monkeypatch.setattr(fr, "VARIANT_CANDIDATES", {"frontier_e2": own})
    monkeypatch.setattr(fr, "VARIANT_FINALISTS", {"frontier_e2": 0.03})
    monkeypatch.setattr(fr, "FINALISTS_WHY", {"frontier_e2": "Why: one seed is noise."})
    for c in own:
        monkeypatch.setitem(fr.BY_LABEL, c.label, c)
    s = fr.Settings(runs_root=tmp_path / "runs_e", results=base.results, docs=base.docs, rounds=ROUNDS,
                    local_epochs=2)
    assert s.finalist_margin == 0.03 and base.finalist_margin is None

    def val(v: float) -> list[float]:
        return [0.5, 0.7, v]

    seed0 = {"dturbo_base": 0.93, "dturbo_own1": 0.95, "dturbo_own3": 0.91}  # own3: 0.04 behind, not a finalist
    write_fake(fr, s, {(lab, 0): (val(v), val(v), [1, 2, 3], 0.12, 1.0, 1.0) for lab, v in seed0.items()})
    write_fake(fr, s, {(lab, 0): (val(0.9), val(0.9), [1, 2, 3], 1.0, 1.0, 1.0)
                       for lab in ("fedavg32_lr2e-3", "fedavg16_lr1e-3")})
    sel = fr.select(fr.load_runs(s, s.n_rounds), "val_accuracy", s.finalist_margin)
    assert sel.finalists["dturbo"] == ["dturbo_own1", "dturbo_base"] and sel.chosen["dturbo"] == "dturbo_own1"
    assert sel.pending == {"dturbo": ["dturbo_own1", "dturbo_base"]}
    todo = {j.name for j in fr.horizon_jobs(s, "val_accuracy")[0] if j.status == "todo"}
    assert {"dturbo_own1_s1", "dturbo_own1_s2", "dturbo_base_s1", "dturbo_base_s2"} <= todo
    assert not any(n.startswith("dturbo_own3") for n in todo)
    fr.report(base, "val_accuracy")
    fr.report(s, "val_accuracy")
    md = (s.results / "frontier_e2.md").read_text()
    assert "Finalists still lacking seeds (D-Turbo-VBI): `dturbo_own1`, `dturbo_base`" in md
    assert "| D-Turbo-VBI | `dturbo_own1` **chosen** | 1 warm-up rounds | 95.00 | pending |" in md

    # Seeds 1, 2: the seed-0 leader falls behind on the mean (0.95, 0.80, 0.80 against 0.93, 0.92, 0.92).
    write_fake(fr, s, {(lab, sd): (val(v), val(v), [1, 2, 3], 0.12, 1.0, 1.0)
                       for lab, v in (("dturbo_own1", 0.80), ("dturbo_base", 0.92)) for sd in (1, 2)})
    out = fr.report(s, "val_accuracy")
    assert out["chosen"]["dturbo"] == "dturbo_base"
    means = {t["label"]: t["mean_final_val_accuracy"] for t in out["selection"] if t["line"] == "dturbo"}
    assert means == {"dturbo_base": pytest.approx((0.93 + 0.92 + 0.92) / 3),
                     "dturbo_own1": pytest.approx((0.95 + 0.80 + 0.80) / 3), "dturbo_own3": None}
    md = (s.results / "frontier_e2.md").read_text()
    assert "| D-Turbo-VBI | `dturbo_base` **chosen** |" in md and "lacking seeds" not in md
    assert "Why: one seed is noise." in md and "on its mean over seeds 0, 1, 2" in md
    # Beside the choice, never used by it: each finalist's test bits to T (FedAvg-16's 0.90 - 1 point), reached by
    # every seed of dturbo_base in round 3 (3 Mbit) and by one seed of dturbo_own1; dturbo_own3 is no finalist.
    rows = {ln.split("|")[2].strip(): ln for ln in md.splitlines() if ln.startswith("| D-Turbo-VBI | `dturbo_")}
    assert "Mbit to T = 89.0% (test; finalists, mean over seeds) |" in md
    assert rows["`dturbo_base` **chosen**"].endswith("| 3.0 |") and rows["`dturbo_own1`"].endswith("| never (1/3) |")
    assert rows["`dturbo_own3`"].endswith("| - |")

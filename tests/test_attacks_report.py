"""benchmarks/attacks_inside.py's report and screen choice, against values computed by hand on synthetic rows."""

from __future__ import annotations

import json

import pytest
from run_helpers import load_benchmark


@pytest.fixture(scope="module")
def ai():
    return load_benchmark("attacks_inside")


def _row(runner: str, model: str, method: str, attack: str, attackers: int, accuracy: float, **extra) -> dict:
    return {"runner": runner, "model": model, "method": method, "attack": attack, "attackers": attackers,
            "accuracy": accuracy, "stopped": False, "resume_ok": True, "peak_rss_mb": 500.0, "error": None,
            "rounds_done": 12, "clients_rejected": 0, "up_bits": 1.0, "hostile": [], "seconds": 1.0, **extra}


def test_the_report_counts_drops_at_a_tenth_of_a_point_and_the_rules_cost_against_the_plain_mean(ai):
    results = [
        _row("simulator", "mlp", "fedavg", "none", 0, 0.781),
        _row("simulator", "mlp", "fedavg", "none", 0, 0.790, candidate="mean"),
        _row("simulator", "mlp", "fedavg", "scaled_sign_flip", 3, 0.741),  # 4.0 points: within 4
        _row("simulator", "mlp", "fedavg", "alie", 3, 0.740),  # 4.1 points: missed
        _row("simulator", "mlp", "fedavg", "ipm", 1, 0.760),  # 2.1 points: missed
    ]
    res = ai.report(results, 12)
    assert [tuple(r) for r in res["runs"]] == [ai.ROW] * 3  # the plain-mean run is no row of the schema
    assert [why for _, why in res["missed"]["accuracy_or_stop"]] == ["4.1 points", "2.1 points"]
    cost = [{k: v for k, v in c.items() if k != "mean"} for c in res["cost_without_attackers"]]
    assert cost == [{"model": "mlp", "method": "fedavg", "rule": ai.rule_name("fedavg"), "mean_accuracy": 0.790,
                     "accuracy": 0.781}]
    line = next(x for x in ai.summary(res).splitlines() if x.startswith("| fedavg | sim |"))
    assert line.endswith("| +0.9 |")  # 0.9 points below the plain mean without attackers
    assert "+4.0" in line and "+4.1" in line


def test_each_method_takes_the_screen_of_highest_validation_accuracy_the_simpler_on_a_tie(ai):
    runs = ai.CANDIDATE_RUNS
    vals = {"rule": 0.70, "rule_screen": 0.72, "rule_screen_refuse": 0.72}  # a tie: the simpler screen
    results = [{"method": m, "candidate": c, "val_accuracy": v} for m in ("dturbo",) for c, v in vals.items()
               for _ in runs]
    results += [{"method": "stc", "candidate": c, "val_accuracy": 0.6 + 0.01 * i} for i, c in enumerate(vals)
                for _ in runs]
    res = ai.screen_report(results, 12)
    assert res["chosen"] == {"dturbo": "rule_screen", "stc": "rule_screen_refuse"}
    assert res["results"]["fedavg"]["rule"] is None  # a method without its runs chooses nothing
    assert ai.SCREENED.keys() == ai.RULES.keys() and set(ai.SCREENED.values()) <= set(ai.SCREENS)


def test_the_second_round_takes_each_methods_highest_mean_confirmed_over_three_seeds(ai):
    """Seven runs a candidate; the mean on seed 0 decides, a tie keeping the earlier candidate (the first round's
    rule); a candidate that wins on seed 0 meets the first round's rule again over seeds 0-2 (confirm_jobs names
    those runs), and keeps its win only if its mean there is higher."""
    def rows(method: str, cand: str, vals: list[float], seed: int = 0) -> list[dict]:
        return [{"model": model, "method": method, "attack": a, "attackers": k, "candidate": cand, "val_accuracy": v,
                 "seed": seed} for (model, a, k), v in zip(ai.CANDIDATE_RUNS, vals, strict=True)]

    flat = [0.7] * 7
    results = rows("stc", "first", flat) + rows("stc", "rule_mean", flat) + rows("stc", "rule_mean03", flat)
    results += rows("fedpaq", "first", flat) + rows("fedpaq", "rule_mean", [0.7] * 6 + [0.77])  # mean 0.71
    results += rows("fedpaq", "rule_mean03", [0.69] * 7)
    results += rows("dssm", "first", flat) + rows("dssm", "rule_mean", [0.72] * 7) + rows("dssm", "rule_mean03", flat)
    res = ai.SECOND_ROUND.report(results, 12)
    assert res["seed0_chosen"] == {"stc": "first", "fedpaq": "rule_mean", "dssm": "rule_mean"}
    assert res["chosen"] == {"stc": "first", "fedpaq": "first", "dssm": "first"}  # not confirmed yet: the first's
    jobs = ai.SECOND_ROUND.confirm_jobs(results, 12)
    assert {(j["method"], j["candidate"], j["seed"]) for j in jobs} == \
        {(m, c, seed) for m in ("fedpaq", "dssm") for c in ("first", "rule_mean") for seed in (1, 2)}
    assert len(jobs) == 2 * 2 * 2 * len(ai.CANDIDATE_RUNS)
    for seed in (1, 2):  # fedpaq's win holds over 3 seeds (0.71, 0.71, 0.71 against 0.70); dssm's does not
        results += rows("fedpaq", "first", flat, seed) + rows("fedpaq", "rule_mean", [0.71] * 7, seed)
        results += rows("dssm", "first", flat, seed) + rows("dssm", "rule_mean", [0.6] * 7, seed)
    res = ai.SECOND_ROUND.report(results, 12)
    assert res["chosen"] == {"stc": "first", "fedpaq": "rule_mean", "dssm": "first"}
    assert res["confirmed"]["dssm"] == pytest.approx({"first": 0.70, "rule_mean": (0.72 + 0.6 + 0.6) / 3})
    assert res["results"]["fedpaq"]["rule_mean"] == pytest.approx(0.71)  # the table is seed 0's
    assert res["results"]["dturbo"]["first"] is None  # a method without its runs chooses nothing
    assert {m: list(c) for m, c in ai.SECOND.items() if m != "fedpm"} == \
        {m: ["rule_mean", "rule_mean03"] for m in ai.RULES if m != "fedpm"}
    md = ai.SECOND_ROUND.markdown(res)
    assert "| fedpaq | screened against the mean update | **71.0** |" in md and "dssm: seed 0 chose" in md


def test_a_row_over_seeds_is_the_mean_of_its_runs_and_stops_if_one_stopped(ai):
    results = [
        _row("simulator", "mlp", "fedpm", "none", 0, 0.70), _row("simulator", "mlp", "fedpm", "none", 0, 0.74, seed=1),
        _row("simulator", "mlp", "fedpm", "alie", 1, 0.66), _row("simulator", "mlp", "fedpm", "alie", 1, 0.75, seed=1),
        _row("simulator", "mlp", "fedpm", "ipm", 1, 0.71),
        _row("simulator", "mlp", "fedpm", "ipm", 1, None, seed=1, stopped="ValueError: x", peak_rss_mb=900.0),
    ]
    res = ai.report(results, 12)
    alie, ipm = res["runs"]
    assert (alie["accuracy"], alie["clean_accuracy"]) == (0.705, 0.72)  # 1.5 points: within 2
    assert ipm["stopped"] and ipm["accuracy"] is None and ipm["peak_rss_mb"] == 900.0
    assert [k for k, _ in res["missed"]["accuracy_or_stop"]] == ["sim/mlp/fedpm/ipm/1"]
    assert res["seeds"] == [0, 1] and [r["seed"] for r in res["details"][0]["by_seed"]] == [0, 1]
    assert ai.key(results[1]) == "simulator/mlp/fedpm/none/0/s1" and ai.row_key(results[1]) == ai.key(results[0])


def test_reuse_reads_back_the_runs_a_report_keeps_and_refuses_another_rule(ai, tmp_path, monkeypatch):
    results = [_row("simulator", "mlp", m, "none", 0, 0.70 + 0.01 * s, **({"seed": s} if s else {}))
               for m in ("fedavg", "stc") for s in (0, 1)]
    results += [_row("simulator", "mlp", m, "alie", 3, 0.68 - 0.02 * s, **({"seed": s} if s else {}))
                for m in ("fedavg", "stc") for s in (0, 1)]
    results += [_row("simulator", "mlp", "fedavg", "none", 0, 0.71 + 0.01 * s, candidate="mean",
                     **({"seed": s} if s else {})) for s in (0, 1)]
    res = ai.report([r | {"rounds": 12} for r in results], 12)
    monkeypatch.setattr(ai, "RESULTS", tmp_path)
    (tmp_path / "attacks.json").write_text(ai.json.dumps(res))
    back = ai.committed_runs(["fedavg"], 12)
    assert sorted(ai.key(r) for r in back) == sorted(ai.key(r) for r in results if r["method"] == "fedavg")
    again = ai.report(back, 12)
    assert again["runs"] == [r for r in res["runs"] if r["method"] == "fedavg"]
    assert again["cost_without_attackers"][0]["mean_accuracy"] == res["cost_without_attackers"][0]["mean_accuracy"]
    monkeypatch.setitem(ai.RECOMMENDED, "stc", {"robust.rule": "median"})
    with pytest.raises(SystemExit, match="not today's"):
        ai.committed_runs(["stc"], 12)
    with pytest.raises(SystemExit, match="ran 12 rounds"):
        ai.committed_runs(["fedavg"], 8)


def test_the_recommended_rule_is_each_rounds_recorded_choice_and_its_name_says_every_setting(ai):
    """RECOMMENDED follows the rounds' results files: the fourth round's candidate where it chose one (the rule after
    the third with refuse_close), else the third's (the rule after the second with refuse_short), else the rule after
    the second; rule_name names every robust setting."""
    for m, rule in ai.RECOMMENDED.items():
        pick = ai.THIRD_CHOSEN[m]
        assert ai.AFTER_THIRD[m] == ai.THIRD[m].get(pick, ai.AFTER_SECOND[m])
        if pick in ai.FLOORS:
            assert ai.AFTER_THIRD[m] == ai.AFTER_SECOND[m] | {"robust.refuse_short": ai.FLOORS[pick]}
        last = ai.FOURTH_CHOSEN[m]
        assert rule == (ai.AFTER_THIRD[m] | {"robust.refuse_close": ai.CLOSE[last]} if last in ai.CLOSE
                        else ai.AFTER_THIRD[m])
        name = ai.rule_name(m)
        for k, v in rule.items():
            assert (f"{k.removeprefix('robust.')} {v}" in name) if k != "robust.rule" else name.startswith(v)
    assert ai.THIRD["fedpm"] == {} and set(ai.THIRD["stc"]) == set(ai.FLOORS)
    assert [m for m, c in ai.FOURTH.items() if c] == ["fedpaq"] and set(ai.FOURTH["fedpaq"]) == set(ai.CLOSE)


def test_the_absent_report_puts_the_lost_data_beside_the_attacked_rows_by_hand(ai, tmp_path, monkeypatch):
    """--stage absent: per method and attacker count, the clean runs' and the attackers-absent runs' means over the
    seeds and the points between them; the attacked rows of attacks.json beside them only at the matrix's rounds."""
    seeds = [(0, 0.55, 0.53, 0.59), (1, 0.66, 0.58, 0.51), (2, 0.54, 0.53, 0.45)]
    results = [_row("simulator", "mlp", "fedpm", attack, k, acc, **({"seed": s} if s else {}))
               for s, clean, one, three in seeds
               for attack, k, acc in (("none", 0, clean), ("loss", 1, one), ("loss", 3, three))]
    (tmp_path / "attacks.json").write_text(json.dumps({"rounds": 12, "runs": [
        {"runner": "sim", "model": "mlp", "method": "fedpm", "attack": a, "attackers": 3, "accuracy": 0.52}
        for a in ai.ATTACKS["mlp"]]}))
    monkeypatch.setattr(ai, "RESULTS", tmp_path)
    res = ai.absent_report(results, 12)
    one, three = res["rows"]
    assert (one["attackers"], three["attackers"]) == (1, 3)
    assert one["clean_accuracy"] == pytest.approx((0.55 + 0.66 + 0.54) / 3, abs=1e-4)
    assert three["absent_by_seed"] == [0.59, 0.51, 0.45] and one["attacks"] == {}
    assert three["attacks"] == {a: 0.52 for a in ai.ATTACKS["mlp"]}
    line = next(x for x in ai.absent_markdown(res).splitlines() if x.startswith("| fedpm | 3 |"))
    # clean (55 + 66 + 54) / 3 = 58.3, absent (59 + 51 + 45) / 3 = 51.7: 6.7 points; each attack at 52.0: 6.3
    assert line == "| fedpm | 3 | 58.3% (55.0, 66.0, 54.0) | 51.7% (59.0, 51.0, 45.0) | +6.7 | +6.3 | +6.3 | +6.3 |"
    assert ai.absent_report(results, 24)["rows"][1]["attacks"] == {}  # another length: no attacked rows beside

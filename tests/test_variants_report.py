"""benchmarks/variants.py's summary and rule on hand-made rows: the means, bits to T after round 1's downlink, and
each variant judged on validation accuracy and its own axis, against its own reference; presets.py's rules."""

from __future__ import annotations

import pytest
from run_helpers import load_benchmark


def rows(variant: str, val: list[float], total: float, to_t: list[float | None], drop: float,
         speedup: list[float] | None = None) -> list[dict]:
    return [{"variant": variant, "seed": k, "accuracy": v - 0.01, "val_accuracy": v, "bits_to_t": b,
             "initial_bits": 2e6, "total_bits": total, "steady_down_mbit": 0.1, "largest_drop": drop + 0.01 * k,
             "val_drop": drop, "speedup": None if speedup is None else speedup[k]}
            for k, (v, b) in enumerate(zip(val, to_t, strict=True))]


def test_the_summary_and_the_rule_by_hand():
    v = load_benchmark("variants")
    chosen = rows("chosen", [0.890, 0.886, 0.884], 33e6, [28e6, 30e6, 32e6], 0.06)
    down2 = rows("down2", [0.889, 0.884, 0.883], 26e6, [24e6, 25e6, None], 0.07)  # 0.13 points below: within 0.2
    trained = rows("trained", [0.885, 0.883, 0.880], 33e6, [28e6, 29e6, 31e6], 0.01)  # 0.4 points below
    summary = v.summarize(chosen + down2 + trained, 3)
    assert list(summary) == ["chosen", "down2", "trained"]
    assert summary["chosen"]["bits_to_t_after_initial"] == pytest.approx(28e6)  # (26 + 28 + 30) / 3
    assert summary["down2"]["bits_to_t"] is None and summary["down2"]["seeds_reaching_t"] == 2
    assert summary["down2"]["val_accuracy"] == pytest.approx((0.889 + 0.884 + 0.883) / 3)
    assert summary["trained"]["largest_drop"] == pytest.approx(0.03)
    # down2: fewer total bits within 0.2 validation points; trained: a smaller drop but 0.4 points below
    assert v.recommend(summary) == {"down2": True, "trained": False}
    summary["trained"]["val_accuracy"] = summary["chosen"]["val_accuracy"]
    summary["down2"]["total_bits"] = 34e6
    assert v.recommend(summary) == {"down2": False, "trained": True}


def test_a_variant_is_judged_against_its_own_reference():
    """cut is judged against the detached runs it differs from by one option, not against the chosen setting."""
    v = load_benchmark("variants")
    chosen = rows("chosen", [0.890, 0.888, 0.886], 33e6, [28e6, 30e6, 32e6], 0.06)
    detached = rows("detached", [0.887, 0.886, 0.884], 33e6, [27e6, 31e6, 33e6], 0.07)
    cut = rows("cut", [0.886, 0.884, 0.882], 25e6, [22e6, 24e6, 27e6], 0.07)  # 0.17 below detached, 0.40 below chosen
    summary = v.summarize(chosen + detached + cut, 3)
    assert v.recommend(summary) == {"cut": True}
    summary["cut"]["total_bits"] = 34e6
    assert v.recommend(summary) == {"cut": False}
    assert v.recommend(v.summarize(chosen + cut, 3)) == {}  # without its reference's runs it is not judged


def test_speed_is_a_win_only_when_every_seed_is_faster():
    """flops is judged on the exported model's speedup: faster on every seed than the chosen setting on any."""
    v = load_benchmark("variants")
    chosen = rows("chosen", [0.890, 0.888, 0.886], 33e6, [28e6, 30e6, 32e6], 0.06, [2.49, 2.52, 2.54])
    flops = rows("flops", [0.889, 0.887, 0.886], 40e6, [30e6, 31e6, 33e6], 0.06, [2.60, 2.55, 2.71])
    summary = v.summarize(chosen + flops, 3)
    assert summary["flops"]["speedup"] == pytest.approx((2.60 + 2.55 + 2.71) / 3)
    assert summary["flops"]["speedup_range"] == [2.55, 2.71]
    assert v.recommend(summary) == {"flops": True}
    summary["flops"]["speedup_range"] = [2.53, 2.71]  # seed 2 of the chosen setting times faster: a tie
    assert v.recommend(summary) == {"flops": False}
    untimed = v.summarize(chosen + rows("flops", [0.889, 0.887, 0.886], 40e6, [30e6, 31e6, 33e6], 0.06), 3)
    assert untimed["flops"]["speedup"] is None and v.recommend(untimed) == {"flops": False}


def test_a_variant_judged_on_accuracy_must_be_higher_on_validation():
    """settled_cut_t30 is judged against settled_cut on validation accuracy: a higher mean wins, a tie does not."""
    v = load_benchmark("variants")
    base = rows("settled_cut", [0.888, 0.886, 0.884], 28e6, [24e6, 25e6, 26e6], 0.01)
    wider = rows("settled_cut_t30", [0.890, 0.887, 0.884], 31e6, [25e6, 26e6, 27e6], 0.01)
    summary = v.summarize(base + wider, 3)
    assert v.recommend(summary) == {"settled_cut_t30": True}  # more bits do not count against it: its axis is accuracy
    summary["settled_cut_t30"]["val_accuracy"] = summary["settled_cut"]["val_accuracy"]
    assert v.recommend(summary) == {"settled_cut_t30": False}


def test_a_control_is_reported_but_never_judged():
    """rerun (the chosen setting trained again) has no axis: it is summarised beside the others and left out of the
    rule, whatever its figures; settled_ternary is judged against settled_sign, its own reference."""
    v = load_benchmark("variants")
    chosen = rows("chosen", [0.890, 0.888, 0.886], 33e6, [28e6, 30e6, 32e6], 0.06)
    rerun = rows("rerun", [0.891, 0.889, 0.887], 32e6, [28e6, 29e6, 31e6], 0.05)
    signs = rows("settled_sign", [0.886, 0.884, 0.882], 30e6, [27e6, 28e6, 29e6], 0.06)
    ternary = rows("settled_ternary", [0.885, 0.883, 0.881], 28e6, [26e6, 27e6, 28e6], 0.06)  # 0.10 below signs
    summary = v.summarize(chosen + rerun + signs + ternary, 3)
    assert summary["rerun"]["total_bits"] == pytest.approx(32e6)
    # settled_sign is 0.4 points below the chosen setting; settled_ternary 0.1 below settled_sign, with fewer bits
    assert v.recommend(summary) == {"settled_sign": False, "settled_ternary": True}
    summary["settled_ternary"]["total_bits"] = 30e6  # a tie with settled_sign: not fewer
    assert v.recommend(summary)["settled_ternary"] is False


def test_partial_participation_is_judged_against_its_own_protocol():
    """partial (5 of 10 clients a round) is judged against partial_values8, a reference on the same protocol that is
    itself not judged; neither's bits are set against STC's (10 clients a round)."""
    v = load_benchmark("variants")
    chosen = rows("chosen", [0.890, 0.888, 0.886], 33e6, [28e6, 30e6, 32e6], 0.06)
    values8 = rows("partial_values8", [0.880, 0.878, 0.876], 30e6, [26e6, 27e6, 28e6], 0.06)
    update = rows("partial", [0.879, 0.877, 0.875], 18e6, [15e6, 16e6, 17e6], 0.06)  # 0.1 below values8, 1.1 below
    summary = v.summarize(chosen + values8 + update, 3)
    assert v.recommend(summary) == {"partial": True}
    summary["partial"]["val_accuracy"] = summary["partial_values8"]["val_accuracy"] - 0.0021
    assert v.recommend(summary) == {"partial": False}
    stc = {"bits_to_t": 40e6}
    assert v.vs_stc(30e6, "bits_to_t", "settled_sign", stc) == " (0.750x STC's)"
    assert v.vs_stc(30e6, "bits_to_t", "partial", stc) == v.vs_stc(30e6, "bits_to_t", "partial_values8", stc) == ""
    assert v.vs_stc(None, "bits_to_t", "settled_sign", stc) == v.vs_stc(30e6, "bits_to_t", "chosen", None) == ""


def test_the_presets_option_studies_rules_by_hand():
    """presets.py --stage dead_units / sampling: a preset takes the alternative when its mean final validation
    accuracy over the seeds is at most 0.2 points below the held value's and, for dead_units, its mean total bits are
    fewer."""
    p = load_benchmark("presets")
    cut, detached = p.STUDIES["dead_units"], p.STUDIES["sampling"]

    def row(preset: str, candidate: str, seed: int, val: float, bits: float) -> dict:
        return {"preset": preset, "candidate": candidate, "seed": seed, "final_val_accuracy": val,
                "final_accuracy": val - 0.005, "density": 0.25, "total_bits": bits}

    rows = [row("quick", "kept", 0, 0.870, 42e6), row("quick", "cut", 0, 0.868, 41e6),
            row("quick", "kept", 1, 0.866, 42e6), row("quick", "cut", 1, 0.865, 41e6),  # 0.15 below on the mean
            row("recommended", "kept", 0, 0.860, 23e6), row("recommended", "cut", 0, 0.864, 15e6),
            row("recommended", "kept", 1, 0.862, 23e6), row("recommended", "cut", 1, 0.853, 15e6)]  # 0.25 below
    assert p.study_adopt(cut, rows) == {"quick": True, "recommended": False}
    assert p.study_summary(cut, rows)["recommended"]["cut"]["final_val_accuracy"] == pytest.approx(0.8585)
    rows[1]["total_bits"] = rows[3]["total_bits"] = 43e6  # more bits: kept stays
    assert p.study_adopt(cut, rows)["quick"] is False
    d = {"option": cut.option, "rule": cut.rule, "rows": rows, "summary": p.study_summary(cut, rows),
         "adopt": p.study_adopt(cut, rows)}
    assert "Taken by: none." in p.study_markdown(d) and "total bits are fewer" in cut.rule
    # sampling has no axis (detached is cheaper in time by construction): validation accuracy alone decides
    rows = [row("quick", "local", 0, 0.870, 42e6), row("quick", "detached", 0, 0.867, 42e6),  # 0.3 below
            row("defaults", "local", 0, 0.860, 40e6), row("defaults", "detached", 0, 0.859, 40e6)]
    assert p.study_adopt(detached, rows) == {"quick": False, "defaults": True}
    assert "fewer" not in detached.rule
    # a preset the rule says takes the alternative, and that does not set it, is named: quick keeps local sampling
    d = {"option": detached.option, "rule": detached.rule, "rows": rows, "summary": p.study_summary(detached, rows),
         "adopt": {"quick": True, "defaults": True}}
    assert p.preset_value("quick", detached.option) == "local" and p.preset_value("defaults", detached.option) == \
        "detached"
    assert p.study_markdown(d).rstrip().endswith("Taken by: quick, defaults. Not yet set in: quick.")


def test_the_presets_warmup_rule_by_hand():
    """presets.py --stage warmup: a preset takes the rising rate when round 1 reaches 15% on validation and its final
    validation accuracy is at most 0.2 points below the constant rate's."""
    p = load_benchmark("presets")

    def row(preset: str, candidate: str, first: float, final: float) -> dict:
        return {"preset": preset, "candidate": candidate, "val_accuracy_by_round": [first, final],
                "final_val_accuracy": final}

    rows = [row("quick", "constant", 0.14, 0.8728), row("quick", "warmup2", 0.43, 0.8708),  # 0.2 below: taken
            row("recommended", "constant", 0.12, 0.8622), row("recommended", "warmup2", 0.37, 0.8601)]  # 0.21 below
    assert p.warmup_adopt(rows) == {"quick": True, "recommended": False}
    rows[1]["val_accuracy_by_round"][0] = 0.149  # round 1 still within 5 points of chance
    assert p.warmup_adopt(rows)["quick"] is False


def test_a_presets_run_is_reused_only_for_the_same_config_as_written(tmp_path, monkeypatch):
    """A cached run whose config.toml lacks a key added since (or holds another value) is trained again."""
    import subprocess

    from dturbo.settings import load_config

    p = load_benchmark("presets")
    cfg = load_config(preset="quick")
    out = tmp_path / "quick"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"")
    (out / "config.toml").write_text(cfg.to_toml())
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    assert p.run("quick", cfg, out) == out and calls == []  # the same config: reused
    (out / "config.toml").write_text(cfg.to_toml().replace('global_model = "trained"\n', ""))
    p.run("quick", cfg, out)
    assert len(calls) == 1 and not (out / "model.safetensors").exists()  # an older run's: trained again

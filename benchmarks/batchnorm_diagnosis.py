"""Why MobileNetV1 with BatchNorm loses accuracy in D-Turbo-VBI's pruning rounds (benchmarks/results/batchnorm.md).

Trains ``mobilenet_dturbo_evidence_s0`` of ``benchmarks/batchnorm.py`` (the same protocol and code; one shared field
spreads the density over every layer, ``dturbo.sparsity.distribution = "evidence"``; or another D-Turbo-VBI run,
``--run``) up to the round of its largest drop (or ``--round``), keeps the server state just before and just after
that round's support rule, and evaluates on the test set, every model with BatchNorm statistics measured on its own
weights over every client's data (:class:`dturbo.algorithms.statistics.Statistics`):

* ``pruned``: the round's model (the support rule's S);
* ``unpruned``: the aggregate before the support rule (the support the clients trained on);
* ``magnitude``: the aggregate pruned to the largest weights, as many per layer as S keeps;
* ``magnitude per channel``: the same on each output channel's weights divided by that channel's norm (BatchNorm
  makes a channel's scale arbitrary, so weights are compared within their channel's scale);
* ``magnitude a round before``: the same counts, chosen by the magnitudes of the round before (the support rule's
  evidence, E3, comes from the previous round's E4);
* ``support rule a round later``: the same counts, chosen by the evidence the next round's support rule will use
  (this round's E4 and Module B's new message);
* ``evidence alone``, ``stale evidence alone``: the same counts, chosen by Module A's evidence (E1) of this round's
  E4, or of the previous round's (the one the support rule used), without Module B's message;
* ``message alone``: the same counts, chosen by Module B's new message (E2) alone;
* ``restore <layer>``: the round's model with one layer's weights as before the support rule.

Usage: .venv/bin/python benchmarks/batchnorm_diagnosis.py [--round 8] [--run mobilenet_dturbo_evidence_s0]
Writes ``benchmarks/results/batchnorm_diagnosis.{json,md}`` (another run or round:
``batchnorm_diagnosis_<run>_r<round>.{json,md}``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import batchnorm  # noqa: E402
from harness import write_results  # noqa: E402

RESULTS = HERE / "results"
RUN = "mobilenet_dturbo_evidence_s0"


class Stop(Exception):
    pass


def diagnose(round_no: int, run: str = RUN) -> dict[str, Any]:
    """Train ``run`` to round ``round_no`` and evaluate the models of the module docstring."""
    import torch

    from dturbo import sim, turbo
    from dturbo.algorithms.dturbo.server import DturboServer
    from dturbo.algorithms.statistics import Statistics

    torch.set_num_threads(1)
    found: dict[str, Any] = {}
    keep_init, keep_step = sim.Simulator.__init__, DturboServer._server_step

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        keep_init(self, *args, **kwargs)
        found["sim"] = self

    def step(self: DturboServer, state: dict[str, Any], trained: Any, round_idx: int) -> dict[str, float]:
        before = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}
        metrics = keep_step(self, state, trained, round_idx)
        if round_idx + 2 == round_no:
            found["previous"] = before
        if round_idx + 1 == round_no:
            found.update(server=self, before=before, after=state)
            raise Stop
        return metrics

    sim.Simulator.__init__, DturboServer._server_step = init, step  # type: ignore[method-assign]
    out = Path(tempfile.mkdtemp(prefix="bn_diagnosis_"))
    try:
        batchnorm.one(run, out)
    except Stop:
        pass
    finally:
        sim.Simulator.__init__, DturboServer._server_step = keep_init, keep_step  # type: ignore[method-assign]
        shutil.rmtree(out, ignore_errors=True)
    runner, server, before, after = found["sim"], found["server"], found["before"], found["after"]
    previous = found["previous"]
    stats = Statistics(server.global_model(after))
    weights = [len(c) for c in runner.fed.clients]

    def accuracy(state: dict[str, Any]) -> float:
        model = server.global_model(state)
        measured = [stats.decode(stats.measure(model, c, 64, runner.device)) for c in runner.fed.clients]
        return sim.evaluate(server.global_model(stats.pool(state, weights, measured)), runner.fed.x_test,
                            runner.fed.y_test)[0]

    def with_layers(chosen: dict[str, np.ndarray]) -> dict[str, Any]:
        return after | {f"{n}.mu": mu for n, mu in chosen.items()}

    def top(score: np.ndarray, mu: np.ndarray, k: int) -> np.ndarray:
        keep = np.zeros(mu.size, dtype=bool)
        keep[np.argsort(-score.reshape(-1), kind="stable")[:k]] = True
        return np.where(keep.reshape(mu.shape), mu, 0.0)

    names = [info.name for info in server.layers]
    counts = {n: int(np.count_nonzero(after[f"{n}.mu"])) for n in names}
    full = {n: before[f"{n}.mu"] for n in names}

    def chosen(score: dict[str, np.ndarray]) -> float:
        """Accuracy with each layer's aggregate pruned to the support rule's count of its highest ``score``."""
        return accuracy(with_layers({n: top(score[n], full[n], counts[n]) for n in names}))

    def evidence(state: dict[str, Any]) -> dict[str, np.ndarray]:
        """E1 of the E4 held in ``state``."""
        return {i.name: turbo.support_evidence(state[f"{i.name}.a_tilde"], state[f"{i.name}.b_tilde"], i.prior)
                for i in server.layers}

    fresh = evidence(after)
    res: dict[str, Any] = {
        "pruned": accuracy(after),
        "unpruned": accuracy(with_layers(full)),
        "magnitude": chosen({n: np.abs(full[n]) for n in names}),
        "magnitude per channel": chosen(
            {n: np.abs(full[n]) / (np.linalg.norm(full[n], axis=1, keepdims=True) + 1e-12) for n in names}),
        "magnitude a round before": chosen({n: np.abs(previous[f"{n}.mu"]) for n in names}),
        "support rule a round later": chosen({n: after[f"{n}.pi_logodds"] + fresh[n] for n in names}),
        "evidence alone": chosen(fresh),
        "message alone": chosen({n: after[f"{n}.pi_logodds"] for n in names}),
        "stale evidence alone": chosen(evidence(before)),
        "restore": {n: accuracy(with_layers({n: full[n]})) for n in names},
        "density_before": float(sum(np.count_nonzero(full[n]) for n in names) / sum(full[n].size for n in names)),
        "density_after": float(sum(counts.values()) / sum(full[n].size for n in names)),
    }
    return res


def markdown(res: dict[str, Any]) -> str:
    best = max(res["restore"].items(), key=lambda kv: kv[1])
    how = batchnorm.VARIANT_LABELS.get(batchnorm.parse_run_name(res["run"])[1], "the library's defaults")
    lines = [
        "# Why MobileNetV1 with BatchNorm falls in a pruning round", "",
        f"`{res['run']}` of `benchmarks/batchnorm.py` ({how}), round {res['round']} "
        f"(support from {100 * res['density_before']:.1f}% "
        f"to {100 * res['density_after']:.1f}% of the weights); test accuracy with BatchNorm statistics measured on "
        "each model's own weights over every client's data; generated by `benchmarks/batchnorm_diagnosis.py`.", "",
        "| model | accuracy |", "|---|---|"]
    for key in ("unpruned", "pruned", "magnitude", "magnitude per channel", "magnitude a round before",
                "support rule a round later", "evidence alone", "stale evidence alone", "message alone"):
        lines.append(f"| {key} | {100 * res[key]:.2f}% |")
    lines += ["", "Every row below `pruned` keeps, in each layer, as many weights as the support rule kept, chosen by: "
              "|mu| (`magnitude`); |mu| over its output channel's norm; |mu| of the previous round's aggregate; "
              "logit(pi) + E1 as the next round's rule will see them; E1 of this round's E4 alone; E1 of the "
              "previous round's E4 alone (what this round's rule used, without Module B); Module B's new message "
              "alone.",
              "", f"Restoring one layer to its weights before the support rule: at best {100 * best[1]:.2f}% "
              f"(layer `{best[0]}`); every layer: "
              + ", ".join(f"`{n}` {100 * a:.1f}" for n, a in res["restore"].items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--round", type=int, default=8, help="the pruning round to take apart (1-based)")
    ap.add_argument("--run", default=RUN, help=f"a run of benchmarks/batchnorm.py (default {RUN})")
    args = ap.parse_args(argv)
    if batchnorm.VARIANTS[batchnorm.parse_run_name(args.run)[1]][0] != "dturbo":
        ap.error(f"--run {args.run}: not a D-Turbo-VBI run of benchmarks/batchnorm.py")
    res = {"run": args.run, "round": args.round, **diagnose(args.round, args.run)}
    name = "batchnorm_diagnosis"
    if (args.run, args.round) != (RUN, 8):
        name += f"_{args.run}_r{args.round}"
    write_results(RESULTS, name, res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

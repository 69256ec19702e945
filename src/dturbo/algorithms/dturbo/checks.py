"""D-Turbo-VBI's warnings about a configuration, raised before a run starts (``AlgorithmSpec.run_warnings``): a
sparsity schedule that does not reach its target within the run, and pruning while clients train only a few local
steps a round."""

from __future__ import annotations

import warnings
from typing import Any

from ...config import Config
from ...protocol import ScheduleWarning
from ..local import num_local_steps
from ..plain import DenseStateWarning, PlainState
from .sparsity import local_steps_a_round, pruning_schedule

__all__ = ["FEW_LOCAL_STEPS", "LocalStepsWarning", "ScheduleWarning", "local_steps_warning", "run_warnings",
           "schedule_warning"]

# Fewer local steps a round than this (the median client's) and D-Turbo-VBI's pruning outpaces the training that
# repairs it (docs/models.md#tune-for-a-new-dataset).
FEW_LOCAL_STEPS = 10


class LocalStepsWarning(ScheduleWarning):
    """A D-Turbo-VBI run that prunes while its clients train only a few local steps a round."""


def schedule_warning(cfg: Config, steps: int | None = None) -> str | None:
    """In target mode, when the final model does not reach the target: the density the schedule gives it and how to
    reach the target; None when it is reached. With ``global_model = "trained"`` the final model holds the support
    the last round trained, which the round before decided, so the ramp must end a round before the last; with
    "cut", at the last. ``steps``: the mean client's local steps a round, which pace a warm-up or ramp not set in
    rounds (:func:`dturbo.algorithms.dturbo.sparsity.pruning_schedule`); None: unknown yet, taken as 1 (the longest
    paced schedule, which still fits the run)."""
    sp = cfg.dturbo.sparsity
    rounds = cfg.experiment.rounds
    if sp.mode != "target":
        return None
    schedule = pruning_schedule(sp, rounds, steps or 1)
    warmup, ramp = schedule.warmup, schedule.ramp
    lag = int(cfg.dturbo.global_model == "trained")
    last = rounds - lag  # the rounds whose decided support the final model holds
    if warmup + ramp <= last:
        return None
    reached = schedule.density(last - 1, sp.target_density) if last > 0 else 1.0
    fix = f"set experiment.rounds >= {warmup + ramp + lag}"
    if last > warmup:
        fix += f" or dturbo.sparsity.ramp_rounds <= {last - warmup}"
    else:
        fix += f" or dturbo.sparsity.warmup_rounds < {last} with a shorter ramp_rounds"
    fix += " (or leave both unset: a schedule paced by local steps always fits the run)"
    layers = " (the layer_targets likewise)" if sp.layer_targets else ""
    trained = (" and the final model (global_model = \"trained\") holds the support of the round before the last"
               if lag else "")
    return (f"the sparsity schedule does not reach target_density {sp.target_density:g} within the run: "
            f"warmup_rounds {warmup} + ramp_rounds {ramp} > experiment.rounds {rounds}{' - 1' if lag else ''}"
            f"{trained}, so the final model's scheduled density is {reached:.3f}{layers}; to reach the target, "
            f"{fix}")


def local_steps_warning(cfg: Config, fed: Any) -> str | None:
    """Pruning to a target (< 1): a warning when the median client of ``fed`` (its ``clients``) trains fewer than
    ``FEW_LOCAL_STEPS`` local steps a round, with the knobs that fix it; else None (and with no clients known)."""
    sp = cfg.dturbo.sparsity
    clients = getattr(fed, "clients", None)
    if sp.mode != "target" or sp.target_density >= 1 or not clients:
        return None
    sizes = sorted(len(c) for c in clients)
    samples = sizes[len(sizes) // 2]
    steps = num_local_steps(cfg.train, samples)
    if steps >= FEW_LOCAL_STEPS:
        return None
    tr = cfg.train
    warmup = (f"dturbo.sparsity.warmup_rounds = {sp.warmup_rounds}: leave it unset to pace it by local steps"
              if sp.warmup_rounds is not None else "dturbo.sparsity.warmup_steps")
    how = (f"train.local_steps = {tr.local_steps}" if tr.local_steps > 0 else
           f"train.local_epochs = {tr.local_epochs:g} of {samples} samples in batches of {tr.batch_size}")
    return (f"the median client trains only {steps} local steps a round ({how}): D-Turbo-VBI prunes between rounds, "
            f"and so few steps leave the pruned model little training to recover, which costs accuracy; raise "
            f"train.local_epochs or train.local_steps to >= {FEW_LOCAL_STEPS} steps a round, or warm up longer "
            f"({warmup}); docs/models.md#tune-for-a-new-dataset")


def run_warnings(cfg: Config, fed: Any) -> list[Warning]:
    """D-Turbo-VBI's ``AlgorithmSpec.run_warnings``: the schedule's, paced by the mean client's local steps, then
    the few local steps'."""
    out: list[Warning] = []
    steps = local_steps_a_round(cfg.train, fed.total_samples, cfg.federation.clients)
    if (msg := schedule_warning(cfg, steps)) is not None:
        out.append(ScheduleWarning(msg))
    if (msg := local_steps_warning(cfg, fed)) is not None:
        out.append(LocalStepsWarning(msg))
    return out


def announce_dense(plain: PlainState, dense: int, everything: int) -> None:
    """One line naming the modules whose state stays dense, with their value counts (a DenseStateWarning)."""
    modules = ", ".join(f"{name or '(model)'} {n:,}" for name, n in plain.by_module().items())
    warnings.warn(f"state outside the Bayesian layers travels dense every round and lies outside the supports: "
                  f"{modules} values; with the biases {dense:,} of the model's {everything:,} values "
                  f"({dense / everything:.1%}); metrics.csv's density counts the supports' weights, density_all "
                  f"every value, dense_share the share that travels dense", DenseStateWarning, stacklevel=3)

"""Experiment configuration: the sections every run reads, and how TOML and ``--set`` overrides become them.

This module knows no method. The full configuration class, these sections and one section per registered method,
is composed by the registry (:func:`dturbo.algorithms.registry.config_class`), and :mod:`dturbo.settings` reads a
file, a mapping or a preset into it. Every section forbids unknown keys, and every error names the offending key
(``section.key``) and what is expected, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Probability = float
# how quantised values are written (dturbo.coding.values): fixed-length, or range-coded (lossless, fewer bits)
ValuesCode = Literal["fixed", "range"]


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""


class _Section(BaseModel):
    # strict: a value must have its declared type (``clients = true`` or ``rounds = "20"`` are refused, not
    # coerced); pydantic's strict mode still takes an int where a float is declared (``lr = 1``).
    # allow_inf_nan=False: inf or nan is never a valid setting (``lr = inf`` is refused with the key's name).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


# The base of every config section, a method's own included: unknown keys refused, strict types, no inf or nan.
Section = _Section


class ExperimentConfig(_Section):
    name: str = "experiment"
    seed: int = Field(0, ge=0, le=2**63 - 1, description="seeds every draw of the run (an integer below 2**63)")
    rounds: int = Field(10, ge=1, le=100_000)
    algorithm: str = Field("dturbo", description="a registered method (dturbo.algorithms.ALGORITHMS)")
    eval_every: int = Field(1, ge=1, description="evaluate the global model every this many rounds (and the last)")
    threads: int = Field(0, ge=0, description="torch threads; 0 keeps torch's default")
    device: Literal["cpu", "cuda", "auto"] = Field("cpu", description=(
        "where clients train and the global model is evaluated (the server's closed forms and Module B stay on "
        "the CPU); auto: cuda when torch sees a GPU, else cpu"))


class DataConfig(_Section):
    name: Literal["fashion-mnist", "mnist", "cifar10", "cifar100", "npz", "arrays"] = Field(
        "fashion-mnist", description="arrays: in-memory arrays given to dturbo.Experiment(data=...), nothing on disk")
    path: str | None = None
    limit_train: int | None = Field(None, ge=1)
    limit_test: int | None = Field(None, ge=1)
    layout: Literal["auto", "channels_first"] = Field("auto", description=(
        "how arrays (npz, in memory) are read: auto, N,H,W (one channel added), N,C,H,W or N,H,W,C images, "
        "N,C,D,H,W volumes, N,D features; channels_first, every array as given with channels on axis 1 (N,C,L "
        "sequences for a Conv1d model)"))
    standardize: bool = Field(True, description=(
        "standardise the inputs per channel with the training set's statistics; false: float inputs as given "
        "(uint8 pixels scaled to 0..1). Integer inputs other than uint8 are ids (tokens) and never standardised"))
    validation: float = Field(0.0, ge=0, lt=1, description=(
        "fraction of the training set held out (seeded, before the clients' split) to choose hyperparameters on: "
        "val_accuracy / val_loss columns; 0: none"))


class FederationConfig(_Section):
    clients: int = Field(10, ge=1)
    partition: Literal["dirichlet", "iid"] = "dirichlet"
    alpha: float = Field(0.5, gt=0)
    clients_per_round: int | None = Field(None, ge=1, description="None: every client every round")
    min_partition_size: int = Field(10, ge=1)
    min_clients: int = Field(1, ge=1, description="fewest valid client updates a round may aggregate")
    on_too_few: Literal["retry", "stop"] = Field(
        "retry", description="a round with fewer than min_clients valid updates is run again, or the run stops"
    )
    max_retries: int = Field(3, ge=0, description="attempts after the first before the run stops")
    batchnorm: Literal["calibrated", "averaged"] = Field("calibrated", description=(
        "BatchNorm's running statistics of the global model: measured on it by the next round's clients after "
        "every evaluated round (one more downlink and a few floats up, counted), or the clients' averaged"))

    @model_validator(mode="after")
    def _per_round_le_clients(self) -> FederationConfig:
        if self.clients_per_round is not None and self.clients_per_round > self.clients:
            raise ValueError(
                f"clients_per_round ({self.clients_per_round}) cannot exceed clients ({self.clients})"
            )
        if self.min_clients > self.clients:
            raise ValueError(f"min_clients ({self.min_clients}) cannot exceed clients ({self.clients})")
        return self


class FaultsConfig(_Section):
    """Fault injection in the simulator (seeded, so a resumed run meets the same faults).

    Each selected client, each round, independently: does not answer (``drop_prob``); answers with corrupted
    bytes (``corrupt_prob``: truncated, garbage, a flipped header byte, oversized, another message kind); or is
    a straggler: its round takes ``slowdown`` times its nominal time, slowdown ~ lognormal(0, straggler_sigma),
    and an answer slower than ``deadline`` (a slowdown factor) misses the round."""

    drop_prob: Probability = Field(0.0, ge=0, le=1)
    corrupt_prob: Probability = Field(0.0, ge=0, le=1)
    straggler_sigma: float = Field(0.0, ge=0)
    deadline: float | None = Field(None, gt=0, description="max slowdown factor; None: wait for everyone")
    attackers: int = Field(0, ge=0, description=(
        "hostile clients (chosen seeded once per run): each trains honestly, then rewrites its upload (attack)"))
    attack: Literal["values", "overflow", "sign_flip", "samples", "loss", "copy", "spoof", "scaled_sign_flip",
                    "alie", "ipm", "plain_state", "calibration"] = Field(
        "values", description=(
            "what an attacker does to its upload: values (every value +-65504), overflow (every value +-3e38 in "
            "float32), sign_flip (values times -4, sigma times 4: inside the bounds), samples (n_t = every sample "
            "of the federation), loss (a NaN, Inf or -1e300 training loss), copy (another client's upload of the "
            "round), spoof (its own upload under another client's id); inside the bounds, from the round's honest "
            "uploads: scaled_sign_flip (the update reversed, stretched to 0.9 of the bound), alie (honest mean "
            "less z standard deviations), ipm (-0.1 times the honest mean update); with BatchNorm: plain_state "
            "(its state reversed to its bound), calibration (statistics at the bound); docs/robustness.md"))


MAX_HIDDEN = 65536  # the widest hidden layer of the mlp
ALEXNET_WIDTHS = (6, 16, 32, 64, 120, 84)  # alexnet-small's conv1-4 and dense1-2


class RobustConfig(_Section):
    """Robust aggregation (docs/robustness.md): the rule that combines the clients' vectors (D-Turbo-VBI: mu on
    the support, sigma and biases before E3/E4; the baselines: their weights or updates). ``mean`` is the plain
    weighted mean."""

    rule: Literal["mean", "median", "trimmed_mean", "krum", "bulyan", "centered_clip"] = Field("mean", description=(
        "mean (weighted by n_t), median (coordinate-wise), trimmed_mean (coordinate-wise, trim of each end), krum "
        "(multi-Krum: the n - byzantine uploads of lowest Krum score, their weighted mean), bulyan (Krum selection "
        "of n - 2 byzantine, then the coordinate-wise mean of the n - 4 byzantine values nearest the median), "
        "centered_clip (from the coordinate-wise median, iterations steps of the mean of the uploads' differences "
        "from the centre, each clipped to radius times their median length)"))
    trim: float = Field(0.2, ge=0, lt=0.5, description="trimmed_mean: the fraction of uploads dropped at each end "
                                                         "of every coordinate")
    byzantine: int = Field(1, ge=0, description=(
        "krum, bulyan, trimmed_mean: the hostile uploads a round is assumed to hold, less those refused already; "
        "trimmed_mean trims at least this many at each end, and so do krum below n = 2 byzantine + 3 uploads and "
        "bulyan below 4 byzantine + 3"))
    radius: float = Field(1.0, gt=0, description="centered_clip: the clipping radius, in median lengths")
    iterations: int = Field(3, ge=1, le=100, description="centered_clip: the steps from the median")
    clip_norm: float | None = Field(None, gt=0, description=(
        "each upload's update (its vector minus the global model's) scaled to at most this L2 norm before the "
        "rule; None: no clipping"))
    clip_median: float | None = Field(None, gt=0, description=(
        "each upload's update scaled to at most this times the median L2 norm of the round's updates before the "
        "rule (after clip_norm); None: no clipping"))
    min_cosine: float | None = Field(None, ge=-1, lt=1, description=(
        "each upload whose update has a cosine below this with the round's coordinate-wise median update is refused "
        "before the rule, with the reason (a reversed update: sign flipping, inner-product manipulation); None: none"))
    cosine_to: Literal["median", "mean"] = Field("median", description=(
        "min_cosine: the round's update each upload's is compared with: the coordinate-wise median of the updates, or "
        "the mean of the other uploads' updates, clipped as the rule clips them (sparse updates, whose median is 0 "
        "nearly everywhere)"))
    refuse_median: float | None = Field(None, gt=1, description=(
        "each upload whose update has an L2 norm above this times the round's median update norm is refused before "
        "clipping, with the reason (an update stretched to the value bound); None: every upload is clipped instead"))
    refuse_short: float | None = Field(None, gt=0, lt=1, description=(
        "each upload whose update has an L2 norm below this times the round's median update norm is refused before "
        "clipping, with the reason (a colluding update built from the honest mean: ALIE, IPM; an update shorter "
        "than most honest ones); None: none"))
    refuse_close: float | None = Field(None, gt=0, lt=1, description=(
        "each upload whose update lies within this times the round's median distance between updates of another "
        "upload's is refused before clipping, both of them, with the reason (colluding uploads built from one "
        "vector: ALIE, IPM; honest clients' data differ); None: none"))


class ModelConfig(_Section):
    name: Literal["alexnet-small", "lenet5", "mlp", "mobilenet-v1", "custom"] = Field(
        "alexnet-small", description="custom: a model given to dturbo.Experiment(model=...), not built from the config")
    hidden: list[int] = Field(default_factory=lambda: [200, 100], description="mlp only; each size at most 65536")
    width: float = Field(1.0, gt=0, le=4, description="mobilenet-v1 width multiplier")
    widths: list[int] | None = Field(None, description=(
        "alexnet-small only: the widths of conv1-4 and dense1-2 (None: 6, 16, 32, 64, 120, 84), e.g. a pruned "
        "run's exported architecture, to train it dense"))

    @field_validator("widths")
    @classmethod
    def _six_widths(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) != len(ALEXNET_WIDTHS) or any(not 1 <= w <= MAX_HIDDEN for w in v)):
            raise ValueError(f"widths must be {len(ALEXNET_WIDTHS)} sizes of 1 to {MAX_HIDDEN} (conv1-4, dense1-2; "
                             f"alexnet-small's are {list(ALEXNET_WIDTHS)}), got {v}")
        return v

    @model_validator(mode="after")
    def _widths_of_alexnet(self) -> ModelConfig:
        if self.widths is not None and self.name != "alexnet-small":
            raise ValueError(f"widths sets alexnet-small's layers; model {self.name!r} takes hidden (mlp) or width "
                             f"(mobilenet-v1)")
        return self

    @field_validator("hidden")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(h < 1 for h in v):
            raise ValueError("hidden sizes must be a non-empty list of positive integers")
        if any(h > MAX_HIDDEN for h in v):
            raise ValueError(f"hidden sizes must be at most {MAX_HIDDEN} (a layer of {max(v)} units does not fit "
                             f"in memory)")
        return v


class TrainConfig(_Section):
    local_epochs: float = Field(1.0, ge=0)
    local_steps: int = Field(0, ge=0, description="if > 0, overrides local_epochs")
    batch_size: int = Field(64, ge=1)
    lr: float | None = Field(None, gt=0, description=(
        "the optimizer's learning rate; None: the algorithm's default, DEFAULT_LR (filled in when the Config is "
        "built)"))
    optimizer: Literal["adam", "sgd"] = "adam"
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description=(
        "the learning rate over rounds: constant, or a cosine from lr in the first round to lr * lr_final in the "
        "last (dturbo.algorithms.local.round_lr)"))
    lr_final: float = Field(0.1, gt=0, le=1, description="cosine: the last round's lr as a fraction of lr")
    lr_decay_start: int = Field(0, ge=0, description=(
        "cosine: rounds trained at lr before the decay starts (e.g. D-Turbo-VBI's warm-up + ramp rounds, so the "
        "decay begins once the support has settled)"))
    lr_warmup_rounds: int = Field(0, ge=0, description=(
        "the first rounds' rate rises linearly: round t (0-based) < w trains at its rate x (t + 1) / (w + 1). Every "
        "client starts the first round from one shared random model; at a high rate their first local epochs on "
        "skewed shards can drift so far apart that their average is no model"))

    @model_validator(mode="after")
    def _some_work(self) -> TrainConfig:
        if self.local_steps == 0 and self.local_epochs <= 0:
            raise ValueError("set local_epochs > 0 or local_steps > 0")
        return self


class Config(_Section):
    """The base of the whole configuration: the class :func:`dturbo.algorithms.registry.config_class` composes
    from :data:`CORE_SECTIONS` and every registered method's section subclasses it (its fields are those sections;
    this base declares none)."""

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


# The sections every run reads, in the order of a config file; the default method's section follows [train]
# (AFTER_DEFAULT_METHOD), the other methods' the last of these.
CORE_SECTIONS: dict[str, type[Section]] = {
    "experiment": ExperimentConfig, "data": DataConfig, "federation": FederationConfig, "model": ModelConfig,
    "train": TrainConfig, "faults": FaultsConfig, "robust": RobustConfig,
}
AFTER_DEFAULT_METHOD = "train"


def _known_keys(schema: type[Config], parts: list[str]) -> list[str]:
    """The keys of the section that ``parts`` (a key's path) names, or of the top level."""
    model: Any = schema
    for p in parts:
        ann = model.model_fields[p].annotation if p in getattr(model, "model_fields", {}) else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _unknown_key(schema: type[Config], key: str) -> str:
    import difflib

    parts = key.split(".")
    known = _known_keys(schema, parts[:-1])
    # a key typed short (``target`` for ``target_density``) first, then the nearest by spelling
    close = [k for k in known if k.startswith(parts[-1])][:1] or difflib.get_close_matches(parts[-1], known, n=1,
                                                                                            cutoff=0.6)
    hint = f" (did you mean '{'.'.join([*parts[:-1], close[0]])}'?)" if close else ""
    return (f"config key '{key}': unknown key{hint}; `dturbo config show --preset quick` prints every key with its "
            f"value")


# The names pydantic gives the members of a union in an error's location (``tie_rows.bool``,
# ``tie_rows.literal['without_batchnorm']``): not keys.
_UNION_MEMBERS = ("bool", "int", "float", "str")
_UNION_PREFIXES = ("literal[", "list[", "dict[", "tuple[", "function-")


def format_error(schema: type[Config], err: ValidationError) -> str:
    """A ValidationError of ``schema`` as ConfigError's text: one line per key (a value that fits no member of a
    union: what each member expects, on one line), a close key for an unknown one."""
    by_key: dict[str, list[Any]] = {}
    for e in err.errors():
        parts = [str(p) for p in e["loc"] if not (isinstance(p, str) and (p in _UNION_MEMBERS
                                                                           or p.startswith(_UNION_PREFIXES)))]
        by_key.setdefault(".".join(parts) or "(top level)", []).append(e)
    lines = []
    for key, errors in by_key.items():
        if errors[0]["type"] == "extra_forbidden":
            lines.append(_unknown_key(schema, key))
        else:
            expects = ", or ".join([errors[0]["msg"]] + [e["msg"][0].lower() + e["msg"][1:] for e in errors[1:]])
            lines.append(f"config key '{key}': {expects} (got {errors[0].get('input')!r})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _declared_type(schema: type[Config], parts: list[str]) -> Any:
    """The annotation of config key ``parts`` (``["experiment", "rounds"]``), or None for an unknown key."""
    model: Any = schema
    ann: Any = None
    for p in parts:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or p not in model.model_fields:
            return None
        ann = model.model_fields[p].annotation
        model = ann
    return ann


def _is_text(ann: Any) -> bool:
    """Whether a key declared ``ann`` takes text: ``str``, a Literal of strings, or either or None."""
    args = [a for a in get_args(ann) if a is not type(None)] if get_origin(ann) in (Union, UnionType) else [ann]
    return bool(args) and all(a is str or (get_origin(a) is Literal and all(isinstance(v, str) for v in get_args(a)))
                              for a in args)


def parse_override_value(schema: type[Config], key: str, raw: str) -> Any:
    """The typed value of ``--set key=raw``: text for a key declared as text (``data.path=/x``,
    ``experiment.name=true``), else TOML (``rounds=20`` an int, ``lr=0.1`` a float, ``hidden=[64, 32]`` a list,
    ``layer_targets={conv1 = 0.3}`` a table); a value that is not TOML stays text and is refused by validation
    with the key's expected type."""
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if _is_text(_declared_type(schema, key.strip().split("."))) and not isinstance(value, str):
        return raw  # a name or path that happens to read as TOML (true, 2024, 1e3)
    return value


def _set_key(data: dict[str, Any], key: str, value: Any, item: str) -> None:
    """Set dotted ``key`` (``section.key``) in ``data`` to ``value``; ``item`` names the override in errors."""
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: {key!r} is not a dotted key such as experiment.rounds")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: '{p}' is not a section")
    node[parts[-1]] = value


def apply_overrides(schema: type[Config], data: dict[str, Any], overrides: Sequence[str] | Mapping[str, Any]
                    ) -> dict[str, Any]:
    """Apply overrides to a raw config mapping: ``section.key=value`` strings, as ``--set`` gives them (value
    typed by :func:`parse_override_value`), or a mapping of dotted keys to values (a string value is typed
    the same way, so ``{"experiment.rounds": "20"}`` equals ``--set experiment.rounds=20``; other values are
    taken as given)."""
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            if not isinstance(key, str):
                raise ConfigError(f"override key {key!r} must be a dotted key such as 'experiment.rounds'")
            if isinstance(value, os.PathLike):
                value = os.fspath(value)  # {"data.path": Path(...)}
            typed = parse_override_value(schema, key, value) if isinstance(value, str) else value
            _set_key(data, key, typed, f"{key}={value!r}")
        return data
    if isinstance(overrides, str | bytes):
        raise ConfigError(f"overrides must be a list of 'section.key=value' strings or a mapping of dotted keys to "
                          f"values, not one string ({overrides!r}): wrap it in a list")
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        _set_key(data, key, parse_override_value(schema, key, raw), item)
    return data


def read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        # e.g. the .npz passed where the config goes: say so instead of a decoding traceback
        hint = (" (it is a zip/.npz archive: data files go in the config's data.path)" if raw[:2] == b"PK"
                else " (it is binary, not text)")
        raise ConfigError(f"{path} is not a TOML file{hint}; pass an experiment config (`dturbo config show "
                          f"--preset quick` prints one to start from)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None

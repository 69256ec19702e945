"""dturbo.load_config: a TOML path, a dict or a Config, with overrides exactly as ``--set`` reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

import dturbo
from dturbo.checkpoint import config_fingerprint
from dturbo.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
QUICK = ROOT / "configs" / "fmnist_quick.toml"


def test_exported_from_the_package():
    from dturbo.algorithms.registry import config_class
    from dturbo.settings import load_config

    assert dturbo.load_config is load_config
    assert dturbo.Config is config_class() and issubclass(dturbo.Config, dturbo.config.Config)
    assert issubclass(dturbo.ConfigError, ValueError)


def test_path_dict_and_config_sources_agree():
    from_path = dturbo.load_config(QUICK)
    from_str = dturbo.load_config(str(QUICK))
    from_dict = dturbo.load_config(from_path.to_dict())
    from_config = dturbo.load_config(from_path)
    assert from_path == from_str == from_dict == from_config
    assert from_path.experiment.name == "fmnist_quick"


def test_overrides_as_list_or_mapping_match_the_cli():
    as_cli = dturbo.load_config(QUICK, ["experiment.rounds=3", "model.hidden=[64, 32]", "data.path=/x",
                                        "dturbo.sparsity.layer_targets={conv1 = 0.3}", "experiment.name=2024"])
    as_text = dturbo.load_config(QUICK, {"experiment.rounds": "3", "model.hidden": "[64, 32]", "data.path": "/x",
                                         "dturbo.sparsity.layer_targets": "{conv1 = 0.3}",
                                         "experiment.name": "2024"})
    as_values = dturbo.load_config(QUICK, {"experiment.rounds": 3, "model.hidden": [64, 32], "data.path": Path("/x"),
                                           "dturbo.sparsity.layer_targets": {"conv1": 0.3},
                                           "experiment.name": "2024"})
    assert as_cli == as_text == as_values
    assert as_cli.experiment.rounds == 3 and as_cli.model.hidden == [64, 32] and as_cli.data.path == "/x"
    assert as_cli.experiment.name == "2024"  # a text key keeps text that reads as TOML


def test_the_source_dict_is_not_modified():
    data = {"experiment": {"rounds": 4}}
    cfg = dturbo.load_config(data, {"experiment.rounds": 2, "train.lr": 0.01})
    assert data == {"experiment": {"rounds": 4}}
    assert cfg.experiment.rounds == 2 and cfg.train.lr == 0.01


@pytest.mark.parametrize("source,overrides,match", [
    ({"experiment": {"roundz": 3}}, None, r"'experiment\.roundz': unknown key"),
    ({}, {"experiment.roundz": 3}, r"'experiment\.roundz': unknown key"),
    ({}, {"experiment.rounds": "many"}, r"'experiment\.rounds'.*'many'"),
    ({}, {"experiment.rounds": True}, r"'experiment\.rounds'"),
    ({}, ["experiment.rounds"], "must look like section.key=value"),
    ({}, "experiment.rounds=3", "not one string"),
    ({}, {"experiment..rounds": 3}, "not a dotted key"),
    ({"experiment": 3}, {"experiment.rounds": 3}, "'experiment' is not a section"),
    ({}, {"experiment.device": "tpu"}, r"'experiment\.device'"),
    (42, None, "not int"),
    ("/no/such/config.toml", None, "cannot read config file"),
])
def test_bad_keys_and_values_raise_config_error_naming_them(source, overrides, match):
    with pytest.raises(ConfigError, match=match):
        dturbo.load_config(source, overrides)


def test_device_key_defaults_to_cpu_and_leaves_the_fingerprint_alone():
    cfg = dturbo.load_config({})
    assert cfg.experiment.device == "cpu"
    on_gpu = dturbo.load_config({}, {"experiment.device": "auto"})
    assert config_fingerprint(on_gpu.to_dict()) == config_fingerprint(cfg.to_dict())
    # the fingerprint of a config written before the key existed is unchanged (resumable runs stay resumable)
    old = cfg.to_dict()
    del old["experiment"]["device"]
    assert config_fingerprint(old) == config_fingerprint(cfg.to_dict())


def test_an_unset_lr_is_the_algorithms_default_and_is_recorded():
    from dturbo.algorithms import ALGORITHMS

    # every algorithm a config may name has a default (its spec's)
    DEFAULT_LR = {name: spec.default_lr for name, spec in ALGORITHMS.items()}
    for algorithm, lr in DEFAULT_LR.items():
        cfg = dturbo.load_config({"experiment": {"algorithm": algorithm}})
        assert cfg.train.lr == lr
        assert cfg.to_dict()["train"]["lr"] == lr  # config.json says what the run trained with
        assert dturbo.load_config(cfg.to_dict()) == cfg
    # the Bayesian layers' larger step (docs/models.md#tune-for-a-new-dataset)
    assert DEFAULT_LR["dturbo"] > DEFAULT_LR["fedavg"]
    explicit = dturbo.load_config({"experiment": {"algorithm": "dturbo"}, "train": {"lr": 0.0007}})
    assert explicit.train.lr == 0.0007
    # an override of the algorithm on a raw config gets that algorithm's default
    assert dturbo.load_config({}, ["experiment.algorithm=fedpm"]).train.lr == DEFAULT_LR["fedpm"]


def test_a_train_section_alone_has_no_lr_to_train_with():
    from torch import nn

    from dturbo.algorithms.local import make_optimizer
    from dturbo.config import TrainConfig

    with pytest.raises(ValueError, match="train.lr is unset"):
        make_optimizer(TrainConfig(), list(nn.Linear(2, 2).parameters()))
    assert make_optimizer(TrainConfig(lr=0.01), list(nn.Linear(2, 2).parameters())).defaults["lr"] == 0.01


@pytest.mark.parametrize(("override", "field"), [("train.lr_schedule=step", "lr_schedule"),
                                                 ("train.lr_final=0", "lr_final"), ("train.lr_final=1.5", "lr_final")])
def test_a_bad_lr_schedule_is_refused_by_name(override, field):
    with pytest.raises(ConfigError, match=field):
        dturbo.load_config({}, [override])
    cfg = dturbo.load_config({}, ["train.lr_schedule=cosine", "train.lr_final=0.2"])
    assert (cfg.train.lr_schedule, cfg.train.lr_final) == ("cosine", 0.2)
    assert dturbo.Config.model_validate(cfg.to_dict()).train.lr_schedule == "cosine"  # recorded in config.toml

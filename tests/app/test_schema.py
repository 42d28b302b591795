"""The config schema (cltrain.app.config.schema): every key typed, every default written once, every group option
composing, the data schemas matching their DataModules, and one-line errors for bad keys and values before
anything runs: in process, for every value of a -m sweep, and through a real `python train.py` (exit status 2)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from cltrain.app.config import ConfigError, check_command_line, compose_config, config_dir, data_schema, schema, validate
from tests.helpers import REPO, SMOKE
from tests.helpers import warm

CONFIG_DIR = config_dir()

GROUPS = ("model", "data", "trainer", "optim", "logger", "callbacks", "experiment")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def _schemas() -> list[type]:
    found, todo = [], [schema.TrainConfig]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        todo += cls.__subclasses__()
        for hint in typing.get_type_hints(cls).values():
            for tp in (hint, *typing.get_args(hint)):
                if dataclasses.is_dataclass(tp):
                    todo.append(tp)
    return found


# --- the schema ------------------------------------------------------------------------------------
#: Keys only the user can set: LitData, MDS and WebDataset datasets keep no class names.
REQUIRED = {"num_classes"}
#: What the data options that read a dataset need on the command line.
NEEDS = {"imagenet": ["data.root={tmp}"], "main_amp": ["data.root={tmp}"], "shards": ["data.root={tmp}"],
         "hf": ["data.root={tmp}"], **{o: ["data.root={tmp}", "data.num_classes=10"] for o in ("litdata", "mds", "webdataset")}}


@pytest.mark.parametrize("cls", _schemas(), ids=lambda c: c.__name__)
def test_every_key_is_typed_and_has_a_default(cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if hints[f.name] is Any:  # Any only where a rule says what is allowed (amp: auto or a boolean ...)
            assert f.metadata.get("rule") is not None, f"{cls.__name__}.{f.name}: Any without a rule"
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        assert has_default, f"{cls.__name__}.{f.name} has no default"
        if f.default == "???" and f.name not in REQUIRED:  # left to a group option, and only in a base schema
            concrete = {c for options in schema.GROUP_SCHEMAS.values() for c in options.values()}
            assert f.name in ("data", "optim", "name", "_target_") and cls not in concrete, f"{cls.__name__}.{f.name}"


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict) or not node:
        return {prefix.rstrip("."): node}
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k != "defaults":
            out.update(_leaves(v, f"{prefix}{k}."))
    return out


def _option_schema(group: str, raw: dict) -> type:
    for entry in raw.get("defaults", []):
        if isinstance(entry, str) and entry.startswith("/schema/"):
            _, sub, name = entry.split("@")[0].strip("/").split("/")
            return schema.GROUP_SCHEMAS[sub][name]
    return typing.get_type_hints(schema.TrainConfig)[group]


@pytest.mark.parametrize("group,option", [(g, o) for g in ("model", "data", "trainer", "optim") for o in _options(g)])
def test_an_option_sets_only_what_differs_from_its_schema(group: str, option: str) -> None:
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / f"{option}.yaml"))
    baseline = OmegaConf.structured(_option_schema(group, raw or {}))
    for key, value in _leaves(raw or {}).items():
        default = OmegaConf.select(baseline, key, throw_on_missing=False)
        default = OmegaConf.to_container(default) if OmegaConf.is_config(default) else default
        assert value != default, f"conf/{group}/{option}.yaml: {key}: {value!r} is the schema's default already"


@pytest.mark.parametrize("option", _options("experiment"))
def test_an_experiment_sets_only_what_differs_from_its_choices(option: str) -> None:
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "experiment" / f"{option}.yaml"))
    choices = [f"{k.split('/')[-1]}={v}" for e in raw.get("defaults", []) for k, v in e.items()]
    baseline = compose_config(choices)
    for key, value in _leaves(raw).items():
        default = OmegaConf.select(baseline, key)
        default = OmegaConf.to_container(default) if OmegaConf.is_config(default) else default
        assert value != default, f"conf/experiment/{option}.yaml: {key}: {value!r} is already the value of its choices"


@pytest.mark.parametrize("option", ["litdata", "mds", "webdataset"])
def test_a_value_only_the_user_knows_left_out_is_one_line_naming_it(option: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate(compose_config([f"data={option}", "data.root=s3://bucket/pack"]))
    assert str(error.value).splitlines() == [str(error.value)] and "data.num_classes='???': not set" in str(error.value)
    assert "whole number > 0" in str(error.value)


def test_config_yaml_only_chooses() -> None:
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml"))
    assert set(raw) == {"defaults", "hydra"}
    assert raw["defaults"][0] == schema.SCHEMA_NAME


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes_into_the_schema(group: str, option: str, tmp_path: Path) -> None:
    cfg = compose_config([f"{group}={option}", *(o.format(tmp=tmp_path) for o in NEEDS.get(option, []))])
    assert isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is schema.TrainConfig
    assert isinstance(OmegaConf.to_object(cfg), schema.TrainConfig)  # every node converts to its dataclass
    assert validate(cfg).accelerator in ("cpu", "cuda")


def _arguments(cls: type) -> set[str]:
    params = inspect.signature(cls).parameters
    names = set(params) - {"self", "args", "kwargs"}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):  # ShardsDataModule passes the rest to its parent
        names |= _arguments(cls.__mro__[1])
    return names


@pytest.mark.parametrize("name,cls", sorted(schema.GROUP_SCHEMAS["data"].items()))
def test_a_data_schema_takes_only_its_datamodules_arguments(name: str, cls: type) -> None:
    from hydra.utils import get_class

    target = get_class(cls._target_)
    keys = {f.name for f in dataclasses.fields(cls)} - {"_target_", "demo"}
    assert keys <= _arguments(target), f"schema/data/{name}: not arguments of {target.__name__}: {keys - _arguments(target)}"


def _drift(cls: type) -> dict[str, tuple[Any, Any]]:
    """key -> (the schema's default, its DataModule's) for every data key whose defaults differ."""
    from hydra.utils import get_class

    params = inspect.signature(get_class(cls._target_)).parameters
    config = OmegaConf.to_container(OmegaConf.structured(cls))  # as the app composes it
    drift = {}
    for name, value in config.items():
        if name in ("_target_", "root", "demo"):
            continue
        default = params[name].default
        default = "???" if default is inspect.Parameter.empty else list(default) if isinstance(default, tuple) else default
        if value != default or type(value) is not type(default):
            drift[name] = (value, default)
    return drift


#: DataModule arguments that are not data.* keys: the app sets channels_last from its toggle; the others
#: are what a batch's pixels are (the model's input), and augmentation is its fields.
NOT_KEYS = {"root", "augmentation", "channels", "mean", "std", "dtype", "channels_last"}


@pytest.mark.parametrize("name,cls", sorted(schema.GROUP_SCHEMAS["data"].items()))
def test_every_data_default_is_its_datamodules_own(name: str, cls: type) -> None:
    from hydra.utils import get_class

    assert _drift(cls) == {}, f"schema/data/{name}: key: (the app's default, {cls._target_}'s)"
    keys = {f.name for f in dataclasses.fields(cls)} - {"_target_", "demo"}
    assert set(inspect.signature(get_class(cls._target_)).parameters) - NOT_KEYS == keys - {"root"}  # every setting a key


def test_a_default_that_differs_from_the_datamodules_is_found() -> None:  # the control
    drifted = dataclasses.make_dataclass("Drifted", [("batch_size", int, 256), ("scale", list[float],
                                         dataclasses.field(default_factory=lambda: [0.5, 1.0]))],
                                         bases=(data_schema.ImageFolderConfig,))
    assert _drift(drifted) == {"batch_size": (256, 64), "scale": ([0.5, 1.0], [0.08, 1.0])}


def test_a_demo_schema_is_its_generators_arguments_and_defaults() -> None:
    from hydra.utils import get_method

    for cls, generator in schema.DEMO_GENERATORS.items():
        defaults = OmegaConf.to_container(OmegaConf.structured(cls))
        defaults.pop("any_root")
        params = {n: p.default for n, p in inspect.signature(get_method(generator)).parameters.items() if n != "root"}
        assert defaults == {n: list(d) if isinstance(d, tuple) else d for n, d in params.items()}, cls.__name__


def test_the_schema_choices_are_the_data_layers() -> None:
    from cltrain.data.augment_ops import AUGMENT_POLICIES
    from cltrain.data.constants import CHECK_MODES
    from cltrain.data.image_folder_dataset import BAD_FILE_POLICIES
    from cltrain.data.crop_kernels import INTERPOLATIONS

    def allowed(cls: type, name: str) -> str:
        return next(f for f in dataclasses.fields(cls) if f.name == name).metadata["rule"].allowed

    assert allowed(data_schema.ImageFolderConfig, "interpolation") == ", ".join(INTERPOLATIONS)
    assert allowed(data_schema.ImageFolderConfig, "augment") == ", ".join(AUGMENT_POLICIES)
    assert allowed(data_schema.ImageFolderConfig, "check_val") == ", ".join(CHECK_MODES)
    assert allowed(data_schema.ClipFolderConfig, "bad_files") == ", ".join(BAD_FILE_POLICIES)


def test_trainer_arguments_pass_through_by_their_own_names() -> None:
    from lightning.pytorch import Trainer

    trainer_args = set(inspect.signature(Trainer).parameters)
    assert {f.name for f in dataclasses.fields(schema.TrainerConfig)} - {"_target_"} <= trainer_args
    assert set(schema.APP_SET_TRAINER_KEYS) <= trainer_args
    cfg = compose_config(["trainer.max_steps=7", "+trainer.detect_anomaly=true", "trainer.deterministic=warn"])
    validate(cfg)
    assert (cfg.trainer.max_steps, cfg.trainer.detect_anomaly, cfg.trainer.deterministic) == (7, True, "warn")


#: Trainer keys whose default is the app's own (the demo run, main_amp's progress lines), not Lightning's.
APP_TRAINER_DEFAULTS = {"max_epochs", "devices", "num_sanity_val_steps", "log_every_n_steps", "enable_progress_bar",
                        "enable_model_summary", "deterministic"}


def test_every_other_trainer_key_has_lightnings_own_default() -> None:
    from lightning.pytorch import Trainer

    lightning = {name: p.default for name, p in inspect.signature(Trainer).parameters.items()}
    schema_defaults = OmegaConf.to_container(OmegaConf.structured(schema.TrainerConfig))
    differ = {k for k, v in schema_defaults.items() if k != "_target_" and v != lightning[k]}
    assert differ == APP_TRAINER_DEFAULTS


COMMON_TRAINER_KEYS = {"max_steps": 3, "accumulate_grad_batches": 2, "gradient_clip_val": 1.0,
                       "gradient_clip_algorithm": "value", "val_check_interval": 0.5, "limit_train_batches": 4,
                       "limit_val_batches": 0.5, "limit_test_batches": 2, "check_val_every_n_epoch": 2,
                       "log_every_n_steps": 5, "num_sanity_val_steps": 1}


def test_the_common_trainer_arguments_are_plain_keys_that_reach_the_trainer() -> None:
    from hydra.utils import instantiate

    overrides = [f"trainer.{k}={v}" for k, v in COMMON_TRAINER_KEYS.items()]
    check_command_line([*overrides, "device=cpu"])  # no + needed
    cfg = compose_config([*overrides, "device=cpu"])
    trainer = instantiate(cfg.trainer, accelerator="cpu", logger=False, enable_checkpointing=False)
    assert trainer.max_steps == 3 and trainer.accumulate_grad_batches == 2
    assert (trainer.gradient_clip_val, trainer.gradient_clip_algorithm) == (1.0, "value")
    assert (trainer.val_check_interval, trainer.check_val_every_n_epoch, trainer.log_every_n_steps) == (0.5, 2, 5)
    assert (trainer.limit_train_batches, trainer.limit_val_batches, trainer.limit_test_batches) == (4, 0.5, 2)
    assert trainer.num_sanity_val_steps == 1


@pytest.mark.filterwarnings("ignore:.*could not find the monitored key")  # max_steps stops before the epoch's validation
def test_plain_max_steps_and_gradient_clip_val_reach_a_real_run(demo_args: list[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from cltrain.app.module import ImageClassifier
    from cltrain.app.train import train
    from cltrain.check import checking

    clipped: list[tuple[Any, Any]] = []
    clip = ImageClassifier.configure_gradient_clipping

    def spy(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if not checking():  # not the first-batch layout check's copies
            clipped.append((gradient_clip_val, gradient_clip_algorithm))
        return clip(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    monkeypatch.setattr(ImageClassifier, "configure_gradient_clipping", spy)
    metrics = train(compose_config([*SMOKE, *demo_args, f"run_dir={tmp_path / 'run'}", "device=cpu",
                                    "trainer.max_steps=3", "trainer.gradient_clip_val=1.0"]))
    assert metrics["status"] == "completed" and metrics["global_step"] == 3  # trainer=debug alone runs 4
    assert clipped == [(1.0, None)] * 3  # Lightning clips by norm (its default algorithm) at every step


@pytest.mark.parametrize("overrides,expected", [([], True), (["trainer.deterministic=true"], False),
                                                 (["trainer.benchmark=false"], False),
                                                 (["trainer.deterministic=true", "trainer.benchmark=true"], True)])
def test_benchmark_defaults_to_true_unless_deterministic(overrides: list[str], expected: bool) -> None:
    assert validate(compose_config([*overrides, "device=cpu"])).benchmark is expected


# --- one-line errors: in process, for sweeps, through the command line -----------------------------
BAD = [
    ("chanels_last=false", "chanels_last=false: unknown key; did you mean channels_last?"),
    ("+chanels_last=false", "chanels_last=false: unknown key; did you mean channels_last?"),
    ("optim.lrr=0.1", "optim.lrr=0.1: unknown key; did you mean optim.lr?"),
    ("seed=abc", "seed='abc': must be a whole number (allowed: 0 .. 2**32-1)"),
    ("amp=fast", "amp='fast': unknown value (allowed: auto, true, false, bf16, fp16)"),
    ("trainer.max_epochs=abc", "trainer.max_epochs='abc': must be a whole number >= -1"),
    ("optim.name=lamb", "optim.name='lamb': the optimizer is chosen by the optim option (allowed: optim=sgd, optim=adamw)"),
    ("ema.decay=1.5", "ema.decay=1.5: must be a number in [0, 1) (allowed: 0 <= value < 1)"),
    ("ema=true", "ema=true: is a group of keys, not a value (allowed: ema.enabled=true)"),
    ("+trainer.precision=bf16-mixed", "trainer.precision='bf16-mixed': set by the app; do not set it here (allowed: use amp"),
    ("trainer.precision=16", "trainer.precision=16: set by the app; do not set it here (allowed: use amp (auto, true"),
    ("trainer.foo=1", "trainer.foo=1: unknown key; see python train.py --help"),
    ("trainer.max_step=100", "trainer.max_step=100: unknown key; did you mean trainer.max_steps?"),
    ("+trainer.max_steps=100", "trainer.max_steps=100: already in the config; set it without the + (allowed: trainer.max_steps=...)"),
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1.0: must be a number >= 0 (allowed: or null)"),
    ("trainer.detect_anomaly=true", ("trainer.detect_anomaly=true: a Lightning Trainer argument the app leaves at Lightning's "
                                     "default; add it with + (allowed: +trainer.detect_anomaly=true)")),
    ("data=imagenett", "data='imagenett': no data option of that name; did you mean data=imagenet? (allowed: demo, hf,"),
    ("+callbacks=early_stoping", "callbacks='early_stoping': no callbacks option of that name; did you mean "
                                 "callbacks=early_stopping?"),
    ("hydra/launcher=slurmm", "hydra/launcher='slurmm': no hydra/launcher option of that name; did you mean "
                              "hydra/launcher=slurm"),
    ("+model=resnet50", "model='resnet50': already chosen in the defaults list; choose it without the + "
                        "(allowed: model=resnet50)"),
    ("+callbacks=early_stopping", "callbacks='early_stopping': already chosen in the defaults list"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_key_or_value_is_one_line_in_process(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_command_line([override, "device=cpu"])
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(ConfigError) as again:  # what train(cfg) callers meet: compose_config, then validate
        validate(compose_config([override, "device=cpu"]))
    assert str(again.value) == str(info.value)


def test_a_key_under_a_group_that_is_null_in_this_config_is_one_line() -> None:
    # data.demo is null under data=imagenet: OmegaConf's assertion and Hydra's traceback, exit status 1
    overrides = ["data=imagenet", "data.root=photos", "data.demo.train_per_class=10", "device=cpu"]
    message = ("data.demo.train_per_class=10: data.demo is null with data=imagenet: it has no keys (allowed: drop "
               "data.demo.train_per_class, or choose a data that has data.demo)")
    for make in (check_command_line, compose_config):
        with pytest.raises(ConfigError) as info:
            make(overrides)
        assert str(info.value) == message
    for given, said in ((["data=imagenet", "data.demo={train_per_class:10}"], "data.demo={'train_per_class': 10}: "
                         "data.demo is null with data=imagenet: it has no keys"),
                        (["data.demo=null", "data.demo.train_per_class=10"], "data.demo.train_per_class=10: "
                         "data.demo=null on this command line: it has no keys (allowed: drop data.demo.train_per_class "
                         "or data.demo=null)")):
        with pytest.raises(ConfigError, match="^" + re.escape(said)):
            check_command_line([*given, "device=cpu"])


@pytest.mark.parametrize("sweep,message", [
    (["seed=1,2,abc"], "seed='abc': must be a whole number"),
    (["ema.decay=0.9,1.5", "seed=1,2"], "ema.decay=1.5: must be a number in [0, 1)"),
    (["model=resnet18,resnet50", "optim.lrr=0.1,0.2"], "optim.lrr=0.1: unknown key; did you mean optim.lr?"),
    (["amp=auto,fast"], "amp='fast': unknown value"),
    (["model=resnet18,resnt50"], "model='resnt50': no model option of that name; did you mean model=resnet50"),
    (["seed=range(0,3)", "trainer.max_epochs=1,abc"], "trainer.max_epochs='abc'"),
])
def test_every_value_of_a_sweep_is_checked_before_it_starts(sweep: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        check_command_line(["-m", *sweep])
    check_command_line(["-m", *(s.replace(",abc", "").replace(",1.5", "").replace(",fast", "").replace(",resnt50", "").replace("optim.lrr", "optim.lr")
                              for s in sweep)])  # the good values pass


@pytest.mark.parametrize("override,good,message", [
    ("hydra.sweeper.n_trial=3", "hydra.sweeper.n_trials=3",
     "hydra.sweeper.n_trial='3': not a setting of this sweeper; did you mean hydra.sweeper.n_trials?"),
    ("hydra.sweeper.n_trials=abc", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_trials='abc': Value 'abc'"),
    ("hydra.sweeper.direction=maximise", "hydra.sweeper.direction=maximize",
     "hydra.sweeper.direction='maximise': Optuna takes minimize or maximize"),
    ("hydra.sweeper.storage=sqlite:///optuna.db", "hydra.sweeper.storage=null",
     "hydra.sweeper.storage='sqlite:///optuna.db': a shared Optuna study needs"),
    ("hydra.launcher.njobs=2", "hydra.launcher.n_jobs=2",
     "hydra.launcher.njobs='2': not a setting of this launcher; did you mean hydra.launcher.n_jobs?"),
])
def test_the_sweeper_s_and_launcher_s_settings_are_checked_as_every_key(override: str, good: str, message: str) -> None:
    # the keys sweeps.md has users type: Hydra's "To append to your config use +..." (wrong advice) or a traceback
    base = ["-m", "hparams_search=optuna", "hydra/launcher=joblib", "experiment=smoke"]
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as info:
        check_command_line([*base, override])
    assert "\n" not in str(info.value)
    check_command_line([*base, good])


@pytest.mark.parametrize("overrides,message", [
    (["callbacks=[default,early_stopping]", "callbacks.early_stopping.patience=abc"],
     "callbacks.early_stopping.patience='abc': must be a whole number (EarlyStopping)"),
    (["logger=tensorboard", "logger.tensorboard.default_hp_metric=maybe"],
     "logger.tensorboard.default_hp_metric='maybe': must be a boolean (TensorBoardLogger)"),
    (["callbacks=[default,early_stopping]", "callbacks.early_stopping.patience=???"],
     "callbacks.early_stopping.patience='???': not set"),
])
def test_a_callback_s_or_logger_s_argument_of_the_wrong_type_is_one_line_before_the_run(overrides, message) -> None:
    # patience=abc trained two epochs, then raised a TypeError inside EarlyStopping
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        check_command_line(overrides)
    check_command_line([*overrides[:-1], overrides[-1].rpartition("=")[0] + "=" + ("3" if "patience" in overrides[-1]
                                                                                  else "true")])


@pytest.mark.parametrize("override,message", [
    ("callbacks=[default,earlystop]", "callbacks='earlystop': no callbacks option of that name; did you mean "
                                      "callbacks=early_stopping"),
    ("logger=[csv,tensorbord]", "logger='tensorbord': no logger option of that name; did you mean logger=tensorboard"),
])
def test_a_mistyped_option_in_a_groups_list_is_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[")):
        check_command_line([override])


@pytest.mark.parametrize("override", ["optim.lr=${oc.env:CLTRAIN_UNSET_VAR}",
                                      "hydra.run.dir=outputs/slurm-${oc.env:CLTRAIN_UNSET_VAR}"])
def test_an_unset_environment_variable_is_one_line(override: str, monkeypatch) -> None:
    # OmegaConf's traceback, exit 1; in hydra.run.dir, Hydra's while it made the run directory
    monkeypatch.delenv("CLTRAIN_UNSET_VAR", raising=False)
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError, match=re.escape(f"{key}='{value}': the environment variable CLTRAIN_UNSET_VAR "
                                                    "is not set (allowed: export CLTRAIN_UNSET_VAR=...")):
        check_command_line([override, "device=cpu"])
    monkeypatch.setenv("CLTRAIN_UNSET_VAR", "0.1")
    check_command_line([override, "device=cpu"])


@pytest.mark.parametrize("body, message", [
    ("trainer:\n  max_steps: abc\n", "trainer.max_steps='abc': must be a whole number"),
    ("  - override model: resnet5\n", "model='resnet5': no model option of that name; did you mean model=resnet50"),
])
def test_a_users_primary_config_in_config_dir_is_checked(tmp_path: Path, body: str, message: str) -> None:
    # --config-dir D --config-name mine: the check found no primary config and let Hydra compose, in 10 lines
    head = "defaults:\n  - config\n" + (body if body.startswith("  -") else "") + "  - _self_\n"
    (tmp_path / "mine.yaml").write_text(head + ("" if body.startswith("  -") else body))
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        check_command_line(["--config-dir", str(tmp_path), "--config-name", "mine", "device=cpu"])
    # named as cltrain's own: Hydra reads cltrain's, and the user's file never (its values silently unused)
    (tmp_path / "mine.yaml").rename(tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match="is not read: Hydra finds cltrain's own config.yaml first"):
        check_command_line(["--config-dir", str(tmp_path), "device=cpu"])


def test_a_launcher_or_sweeper_not_installed_names_the_sweeps_extra() -> None:
    code = ("import sys\n"
            "for m in ('joblib_launcher', 'optuna_sweeper', 'submitit_launcher'): sys.modules['hydra_plugins.hydra_' + m] = None\n"
            "from cltrain.app.config import ConfigError, check_command_line\n"
            "for line in (['-m', 'hydra/launcher=joblib'], ['hparams_search=optuna'], ['-m', 'hydra/launcher=slurm']):\n"
            "    try: check_command_line(line)\n"
            "    except ConfigError as e: print(e)\n")
    done = warm.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["hydra/launcher='joblib'", "hydra/sweeper='optuna'",
                                                      "hydra/launcher='submitit_slurm'"], done.stdout + done.stderr
    assert all(" is not installed: pip install 'cltrain[sweeps]'" in line for line in lines), lines


def test_help_is_left_to_hydra() -> None:
    check_command_line(["--help", "seed=1"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    return warm.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True,
                    timeout=300, cwd=REPO, env=env)


def _assert_one_line_exit_2(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().startswith(f"cltrain: error: {message}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_cli_refuses_a_misspelt_key_with_the_closest_one(tmp_path: Path) -> None:
    result = _cli("chanels_last=false", "device=cpu", f"hydra.run.dir={tmp_path / 'run'}")
    _assert_one_line_exit_2(result, BAD[0][1])
    assert not (tmp_path / "run").exists()  # stopped before Hydra made the run directory


def test_cli_refuses_a_bad_value_in_a_sweep_before_any_job(tmp_path: Path) -> None:
    result = _cli("-m", *SMOKE, "ema.decay=0.9,1.5", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    _assert_one_line_exit_2(result, "ema.decay=1.5: must be a number in [0, 1)")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
def test_the_command_line_entry_point_prints_each_as_one_line_and_exits_2(override: str, message: str, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture) -> None:
    from cltrain.app.cli import main

    monkeypatch.setattr(sys, "argv", ["train.py", override, "device=cpu", f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as exited:
        main()  # what train.py and cltrain-train run, in this process
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith(f"cltrain: error: {message}"), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


# train.py itself, in its own process, for three kinds of error: a value, a "+" on a key the config has, and a
# Trainer argument left at its default (every line of BAD goes through the same entry point above).
CLI_SAMPLE = [b for b in BAD if b[0] in ("seed=abc", "+trainer.max_steps=100", "trainer.detect_anomaly=true")]


@pytest.mark.slow
@pytest.mark.parametrize("override,message", CLI_SAMPLE, ids=[b[0] for b in CLI_SAMPLE])
def test_cli_one_line_exit_2(tmp_path: Path, override: str, message: str) -> None:
    _assert_one_line_exit_2(_cli(override, "device=cpu", f"hydra.run.dir={tmp_path / 'run'}"), message)


@pytest.mark.slow
def test_cli_help_and_cfg_job_show_the_schema() -> None:
    shown = _cli("--help")
    assert shown.returncode == 0 and "ema.enabled=true" in shown.stdout and "amp=auto|true|false|bf16|fp16" in shown.stdout
    job = _cli("--cfg", "job", "ema.enabled=true", "trainer.max_steps=3")
    assert job.returncode == 0, job.stderr
    cfg = OmegaConf.create(job.stdout)
    assert cfg.ema.enabled is True and cfg.trainer.max_steps == 3 and cfg.optim.milestones == [6]


def _documented_commands() -> list[list[str]]:
    """Every ``python train.py ...`` line of the README and docs (comments and line continuations handled)."""
    import shlex

    commands = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = path.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("python train.py"):
                args = [re.sub(r"<[^>]*>", "x", a) for a in shlex.split(line.split(" #", 1)[0], posix=True)[2:]]
                if args and "..." not in " ".join(args):
                    commands.append(args)
    return commands


@pytest.mark.parametrize("args", _documented_commands(), ids=lambda a: " ".join(a)[:60])
def test_every_documented_command_uses_keys_the_schema_has(args: list[str]) -> None:
    check_command_line(args)


@pytest.mark.parametrize("override,fix", [
    ("run_dir=/tmp/dir ü/run", "\"run_dir='/tmp/dir ü/run'\""),
    ("run_dir=/tmp/runs(1)", "\"run_dir='/tmp/runs(1)'\""),
    ("seed=[1,2", "check its brackets and quotes (Hydra's override grammar)"),
])
def test_an_override_hydra_cannot_read_is_one_line_saying_how_to_quote_it(override: str, fix: str) -> None:
    # Hydra's own answer: 'LexerNoViableAltException' over three lines, a URL, exit status 1
    with pytest.raises(ConfigError) as info:
        check_command_line([override, "device=cpu"])
    line = str(info.value)
    assert "\n" not in line and line.startswith(override.split("=")[0] + "=") and "Hydra cannot read" in line, line
    assert line.endswith(fix), line
    if fix.startswith('"'):
        check_command_line([fix.strip('"'), "device=cpu"])  # quoted as the line says: read


def test_a_path_with_a_comma_or_an_apostrophe_gets_quotes_that_read() -> None:
    # a comma read as a sweep (Hydra's "Ambiguous value" over three lines, exit 1, where -m was not given); an
    # apostrophe inside the suggested '...' quotes failed again
    for override, shell in [("run_dir=/tmp/set,v2", "\"run_dir='/tmp/set,v2'\""),
                            ("run_dir=/tmp/it's (1)", "\"run_dir=\\\"/tmp/it's (1)\\\"\"")]:
        with pytest.raises(ConfigError) as info:
            check_command_line([override, "device=cpu"])
        line = str(info.value)
        assert "\n" not in line and line.startswith("run_dir=") and line.endswith(shell), line
        check_command_line([shell[1:-1].replace('\\"', '"'), "device=cpu"])  # as the shell hands it over: read
    check_command_line(["-m", "seed=1,2", "device=cpu"])  # a sweep is a sweep

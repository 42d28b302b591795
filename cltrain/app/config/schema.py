"""The training application's config schema: every key, its type, its default and what it allows.

Hydra structured configs (dataclasses registered in Hydra's ``ConfigStore``): the
schema holds every default once; the yaml files in ``conf/`` only choose and
override. ``conf/config.yaml``'s defaults list starts with ``TrainConfig``
(stored as ``cltrain_schema``); a group whose options differ in shape has one
schema per shape under ``schema/<group>`` that each option's yaml extends
(``conf/data/demo.yaml``: ``defaults: [/schema/data/images_demo@_here_, _self_]``):

* ``schema/data``: ``images`` (``ImageFolderConfig``), ``images_demo``, ``shards``
  (``ShardsConfig``), ``litdata`` (``LitDataConfig``), ``mds`` (``MDSConfig``), ``webdataset`` (``WebDatasetConfig``), ``hf`` (``HFConfig``), ``video`` (``ClipFolderConfig``),
  ``video_demo``;
* ``schema/optim``: ``sgd`` (``SGDConfig``), ``adamw`` (``AdamWConfig``).

The data group's schemas are in ``cltrain.app.config.data_schema`` (and importable from here).
Hydra checks types when it composes (``seed=abc``); each field's rule
(``cltrain.app.config.rules.Rule``, in its metadata) holds the range or choices that
``cltrain.app.config.check.check`` checks after (``ema.decay=1.5``). ``trainer`` has the Trainer
arguments users set most (``trainer.max_steps=100``) and takes any other argument of Lightning's
``Trainer`` by its own name (``+trainer.detect_anomaly=true``), except ``APP_SET_TRAINER_KEYS``.

The library's constructors (``ImageClassifier``, the DataModules, ``EMA``) keep
their own defaults and checks for library users; the app passes every value
from here, so where the two differ (``ImageClassifier``'s schedule is apex
main_amp's 90-epoch one; this schema's fits the 8-epoch demo run) the schema is
what ``train.py`` runs.

Example::

    >>> from omegaconf import OmegaConf
    >>> OmegaConf.structured(SGDConfig).milestones
    [6]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from cltrain.app.config.data_schema import (
    DEMO_GENERATORS,
    ClipFolderConfig,
    ClipFolderDemoConfig,
    DataConfig,
    HFConfig,
    ImageDemoConfig,
    ImageFolderConfig,
    ImageFolderDemoConfig,
    LitDataConfig,
    MDSConfig,
    ShardsConfig,
    VideoDemoConfig,
    WebDatasetConfig,
)
from cltrain.app.config.rules import (
    AMP,
    BETAS,
    CLIP_ALGORITHM,
    COMPILE_MODE,
    COUNT,
    DETERMINISTIC,
    DEVICES,
    FRACTION_OR_COUNT,
    GT_ZERO,
    MAX_STEPS,
    MILESTONES,
    MODE,
    NON_NEGATIVE,
    OPT_NON_NEGATIVE,
    OPT_PATH,
    OPT_POSITIVE,
    POSITIVE,
    SEED,
    STEPS,
    TEXT,
    TOP_K,
    UNIT,
    UNIT_CLOSED,
    VAL_CHECK_INTERVAL,
    choices,
    key,
    optimizer_name,
)
from cltrain.app.schedule import SCHEDULES

__all__ = [
    "APP_SET_TRAINER_KEYS",
    "DEMO_GENERATORS",
    "GROUP_SCHEMAS",
    "KEYS_ELSEWHERE",
    "SCHEMA_NAME",
    "AdamWConfig",
    "CheckpointConfig",
    "ClipFolderConfig",
    "ClipFolderDemoConfig",
    "CompileConfig",
    "DataConfig",
    "EMAConfig",
    "HFConfig",
    "ImageDemoConfig",
    "ImageFolderConfig",
    "ImageFolderDemoConfig",
    "LitDataConfig",
    "MDSConfig",
    "ModelConfig",
    "OptimConfig",
    "SGDConfig",
    "ShardsConfig",
    "TrainConfig",
    "TrainerConfig",
    "VideoDemoConfig",
    "WebDatasetConfig",
    "register",
]


#: Keys whose settings live under another name: an unknown key among these suggests its new place.
KEYS_ELSEWHERE = {
    "amp_dtype": "amp", "sync_bn": "trainer.sync_batchnorm", "cudnn_benchmark": "trainer.benchmark",
    "deterministic": "trainer.deterministic", "compile_backend": "compile.backend", "ema_decay": "ema.decay",
    "ema_warmup_steps": "ema.warmup_steps", "ema_every_n_steps": "ema.every_n_steps",
}


# --- model ----------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """``model``: any torchvision classifier by name, or a timm model; each ``conf/model/*.yaml`` names one."""

    name: str = MISSING                       # resnet50, efficientnet_b0, r3d_18, convnext_atto (timm), ...
    source: str = key("auto", choices("auto", "torchvision", "timm"))  # auto: torchvision first, then timm
    pretrained: str | None = key(None, OPT_PATH)  # a local weights file; nothing is downloaded
    kwargs: dict[str, Any] = key({})          # extra constructor arguments, e.g. {zero_init_residual: true}


# --- trainer --------------------------------------------------------------------------------------
#: Trainer arguments train() sets from other keys: the key to use instead.
APP_SET_TRAINER_KEYS = {
    "accelerator": "device (auto, cpu, cuda, cuda:N, mps)",
    "precision": f"amp ({AMP.allowed})",
    "logger": "logger=csv|tensorboard|mlflow|wandb|none (several: logger=[csv,tensorboard])",
    "callbacks": "callbacks=[default,early_stopping,...] or +callbacks.<name>._target_=<class>",
    "default_root_dir": "run_dir",
    "enable_checkpointing": "checkpoint.save_top_k (last.ckpt is always written)",
    "plugins": "nothing: the app sets its checkpoint IO (atomic saves)",
}


@dataclass
class TrainerConfig:
    """``trainer``: ``lightning.pytorch.Trainer``'s arguments, by their own names.

    The keys here are those the app sets differently from Lightning or reads itself, and
    the ones users set most, at Lightning's defaults (``trainer.max_steps=100``,
    ``trainer.gradient_clip_val=1.0``); any other Trainer argument passes through with
    ``+trainer.<name>=<value>``.
    """

    _target_: str = "lightning.pytorch.Trainer"
    max_epochs: int | None = key(8, STEPS)  # the demo run; experiment=main_amp: 90
    max_steps: int = key(-1, MAX_STEPS)       # optimizer steps; the run stops at whichever limit comes first
    devices: Any = key(1, DEVICES)            # per node; > 1 means DDP (trainer=ddp)
    num_nodes: int = key(1, POSITIVE)
    strategy: str = key("auto", TEXT)
    limit_train_batches: Any = key(None, FRACTION_OR_COUNT)  # per epoch: a count, or a fraction of the loader
    limit_val_batches: Any = key(None, FRACTION_OR_COUNT)
    limit_test_batches: Any = key(None, FRACTION_OR_COUNT)
    val_check_interval: Any = key(None, VAL_CHECK_INTERVAL)  # null: at the end of every epoch
    check_val_every_n_epoch: int | None = key(1, OPT_POSITIVE)  # null: by val_check_interval's batches alone
    num_sanity_val_steps: int = key(0, STEPS)  # Lightning: 2; -1: the whole validation set
    log_every_n_steps: int = key(10, POSITIVE)  # Lightning: 50
    accumulate_grad_batches: int = key(1, POSITIVE)  # batches per optimizer step (the global batch and lr scale with it)
    gradient_clip_val: float | None = key(None, OPT_NON_NEGATIVE)  # null: no clipping
    gradient_clip_algorithm: str | None = key(None, CLIP_ALGORITHM)  # null: norm
    enable_progress_bar: bool = False          # true: a progress bar instead of the main_amp lines (print_freq)
    enable_model_summary: bool = False
    deterministic: Any = key(False, DETERMINISTIC)  # torch deterministic algorithms (+ seeded dataloader workers)
    sync_batchnorm: bool = False              # SyncBatchNorm under DDP (CUDA only)
    # torch.backends.cudnn.benchmark, set by Lightning: time the conv algorithms once per shape (apex, timm).
    # null: true, or false with deterministic=true (Lightning's rule, with apex's default otherwise).
    benchmark: bool | None = None


# --- optimizer and schedule -----------------------------------------------------------------------
@dataclass
class OptimConfig:
    """``optim``: the optimizer (its schema picks it) and the per-step learning-rate schedule."""

    name: str = MISSING                       # set by the optim option's schema: sgd | adamw
    lr: float = key(0.05, GT_ZERO)            # for a global batch of 256 when scale_lr
    scale_lr: bool = True                     # lr x global_batch / 256
    weight_decay: float = key(1.0e-4, NON_NEGATIVE)
    schedule: str = key("step", choices(*SCHEDULES))  # step: main_amp's warm-up + x gamma at milestones | cosine
    warmup_epochs: float = key(1.0, NON_NEGATIVE)  # linear warm-up, both schedules
    milestones: list[int] = key([6], MILESTONES)  # step schedule: epochs at which lr is multiplied by gamma
    gamma: float = key(0.1, GT_ZERO)
    min_lr_ratio: float = key(0.0, UNIT_CLOSED)  # cosine schedule: final lr = lr x min_lr_ratio


@dataclass
class SGDConfig(OptimConfig):
    """``schema/optim/sgd``: apex main_amp.py's SGD, with lr 0.05 for the short demo run."""

    name: str = key("sgd", optimizer_name("sgd"))
    momentum: float = key(0.9, UNIT_CLOSED)
    nesterov: bool = False


@dataclass
class AdamWConfig(OptimConfig):
    """``schema/optim/adamw``: AdamW with the same schedules."""

    name: str = key("adamw", optimizer_name("adamw"))
    lr: float = key(1.0e-3, GT_ZERO)
    weight_decay: float = key(0.05, NON_NEGATIVE)
    betas: list[float] = key([0.9, 0.999], BETAS)


# --- run-wide groups ------------------------------------------------------------------------------
@dataclass
class CompileConfig:
    """``compile``: ``torch.compile`` the model, after the channels_last conversion."""

    enabled: bool = False
    backend: str = key("inductor", TEXT)
    # torch.compile's mode; null: torch's default. reduce-overhead adds CUDA graphs (skipped where the
    # compiled graph mutates BatchNorm's buffers in training: pytorch#139207)
    mode: Any = key(None, COMPILE_MODE)


@dataclass
class EMAConfig:
    """``ema``: an EMA of the weights that validation, checkpoints and metrics.json ("weights") use."""

    enabled: bool = False
    decay: float = key(0.999, UNIT)           # per update; pick it for the run's length (timm 0.9998)
    warmup_steps: int = key(0, COUNT)         # the EMA follows the weights for this many updates first
    every_n_steps: int = key(1, POSITIVE)     # update after every N optimizer steps


@dataclass
class CheckpointConfig:
    """``checkpoint``: what is kept besides ``last.ckpt`` (always written)."""

    save_top_k: int = key(1, TOP_K)           # best checkpoints kept by val/top1 (-1: all, 0: none)


@dataclass
class TrainConfig:
    """The whole config of ``python train.py`` (``conf/config.yaml`` starts from it)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = MISSING
    logger: dict[str, Any] = key({})          # named entries, each {_target_: <Lightning logger>, ...}: conf/logger/
    callbacks: dict[str, Any] = key({})       # named entries, each {_target_: <Lightning callback>, ...}: conf/callbacks/
    # the toggles
    channels_last: bool = True                # true: ChannelsLast callback + NHWC batches; false: contiguous NCHW baseline
    channels_last_mode: str = key("full", MODE)  # what the ChannelsLast callback converts
    # auto: the first training steps race channels_last and NCHW and keep the faster; or pin one (bit-for-bit reruns)
    channels_last_layout: str = key("auto", choices("auto", "channels_last", "contiguous"))
    amp: Any = key("auto", AMP)               # auto: bf16 where native, fp16 on older GPUs, else fp32 | true | false | bf16 | fp16
    device: str = "auto"                      # auto (cuda if available, else cpu) | cpu | cuda | cuda:N | mps
    tf32: bool = True                         # CUDA fp32 convolutions and matmuls in TF32 on Ampere+ (PyTorch's cudnn default)
    # run control
    seed: int = key(42, SEED)
    label_smoothing: float = key(0.0, UNIT)
    compile: CompileConfig = field(default_factory=CompileConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    print_freq: int = key(10, COUNT)          # a main_amp.py style progress line every N training batches (0: never)
    throughput_warmup: int = key(3, COUNT)    # training batches left out of images/second (allocator, cudnn, compile)
    ckpt_path: str | None = key(None, OPT_PATH)  # resume training from this checkpoint (step, schedule, optimizer)
    evaluate_only: bool = False               # validate only: needs ckpt_path=... or model.pretrained=...
    run_dir: str | None = key(None, OPT_PATH)  # null: Hydra's run directory (outputs/<date>/<time>, -1, -2...)


#: The name of ``TrainConfig`` in the ConfigStore (the first entry of conf/config.yaml's defaults list).
SCHEMA_NAME = "cltrain_schema"

#: ``schema/<group>/<name>`` -> the schema a group option's yaml extends.
GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "data": {"images": ImageFolderConfig, "images_demo": ImageFolderDemoConfig, "shards": ShardsConfig,
             "litdata": LitDataConfig, "mds": MDSConfig,
             "webdataset": WebDatasetConfig, "hf": HFConfig, "video": ClipFolderConfig, "video_demo": ClipFolderDemoConfig},
    "optim": {"sgd": SGDConfig, "adamw": AdamWConfig},
}


def register() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent; done when this module is imported)."""
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=TrainConfig)
    for group, options in GROUP_SCHEMAS.items():
        for name, node in options.items():
            store.store(group=f"schema/{group}", name=name, node=node)


register()

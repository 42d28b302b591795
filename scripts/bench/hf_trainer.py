"""Training steps/second of Hugging Face image models under a real ``transformers.Trainer``, NCHW vs channels_last
(the models and the method: docs/benchmarks.md#hf-trainer).

    python -m scripts.bench.hf_trainer                                  # bf16, batch 8 at 128 px, 3 rounds
    python -m scripts.bench.hf_trainer --models resnet,convnext --image-size 224 --precision fp32
    python -m scripts.bench.hf_trainer --device cuda --batch-size 64 --image-size 224
    python -m scripts.bench.hf_trainer --tiny                           # tiny configs: checks the script works
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings
from typing import Any

import torch
from torch import nn

from scripts.fits import StepClock
from scripts.harness import LAYOUTS, interleaved, machine_line, options, table

#: name -> (model class, config class, config arguments at the published size, config arguments for --tiny)
MODELS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "convnext": ("ConvNextForImageClassification", "ConvNextConfig", {},
                 {"num_stages": 2, "hidden_sizes": [8, 16], "depths": [1, 1]}),
    "resnet": ("ResNetForImageClassification", "ResNetConfig", {},
               {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1]}),
    "regnet": ("RegNetForImageClassification", "RegNetConfig", {},
               {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "groups_width": 8}),
    "mobilenet_v2": ("MobileNetV2ForImageClassification", "MobileNetV2Config", {}, {"depth_multiplier": 0.25}),
    "efficientnet": ("EfficientNetForImageClassification", "EfficientNetConfig",
                     {"width_coefficient": 1.0, "depth_coefficient": 1.0, "hidden_dim": 1280},
                     {"width_coefficient": 0.25, "depth_coefficient": 0.25, "hidden_dim": 320}),
    "segformer": ("SegformerForSemanticSegmentation", "SegformerConfig", {},
                  {"num_encoder_blocks": 2, "depths": [1, 1], "sr_ratios": [2, 1], "hidden_sizes": [8, 16],
                   "patch_sizes": [7, 3], "strides": [4, 2], "num_attention_heads": [1, 1], "mlp_ratios": [2, 2],
                   "decoder_hidden_size": 16}),
}
NUM_LABELS = 10


def build(name: str, image_size: int, tiny: bool) -> nn.Module:
    """``name`` from its config (``--tiny``: a few channels), random weights."""
    import transformers

    model_class, config_class, full, small = MODELS[name]
    config = getattr(transformers, config_class)(**(small if tiny else full), num_labels=NUM_LABELS)
    if hasattr(config, "image_size"):
        config.image_size = image_size
    return getattr(transformers, model_class)(config)


def images(n: int, image_size: int, segmentation: bool) -> list[dict[str, torch.Tensor]]:
    """``n`` generated samples: ``pixel_values`` (3, H, W) and a class (a class map for segmentation)."""
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(n, 3, image_size, image_size, generator=g)
    labels = torch.randint(0, NUM_LABELS, (n, image_size, image_size) if segmentation else (n,), generator=g)
    return [{"pixel_values": x, "labels": y} for x, y in zip(pixels, labels)]


def step_clock() -> tuple[Any, StepClock]:
    """A ``TrainerCallback`` that times each step on a ``scripts.fits.StepClock``, and that clock."""
    from transformers import TrainerCallback

    clock = StepClock()

    class Steps(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.begin(state.global_step, args.device)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.end(state.global_step, args.device)

    return Steps(), clock


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Steps/second of ``name`` in both layouts, rounds interleaved."""
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from cltrain.integrations.transformers import ChannelsLastCallback

    torch.manual_seed(0)
    base = build(name, args.image_size, args.tiny)
    data = images(args.batch_size * (args.steps + 1), args.image_size, segmentation="Segformer" in type(base).__name__)
    trainers: dict[str, tuple[Any, StepClock]] = {}
    with tempfile.TemporaryDirectory() as out:
        for layout in LAYOUTS:
            timer, clock = step_clock()
            # verify=False: the first-batch check is a one-off before the first step, not part of a step's time
            extra = [ChannelsLastCallback(verify=False, layout="channels_last")] if layout == "channels_last" else []
            model = build(name, args.image_size, args.tiny)
            model.load_state_dict(base.state_dict())
            settings = TrainingArguments(
                output_dir=out, max_steps=args.steps + 1, per_device_train_batch_size=args.batch_size,
                bf16=args.precision == "bf16", use_cpu=args.device == "cpu", save_strategy="no", report_to="none",
                logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, optim="sgd", learning_rate=1e-3)
            trainer = Trainer(model=model, args=settings, train_dataset=data, callbacks=[*extra, timer])
            trainer.remove_callback(PrinterCallback)  # the end-of-training metrics line, printed at every round
            trainers[layout] = (trainer, clock)

        def train(layout: str) -> list[float]:
            trainer, clock = trainers[layout]
            clock.steps.clear()
            trainer.train()
            return clock.steps[1:] or list(clock.steps)  # the first step of a train() call warms up

        timed = interleaved({layout: (lambda layout=layout: train(layout)) for layout in trainers}, args.repeats)
    rate = {layout: 1 / statistics.median(s for steps in rounds for s in steps) for layout, rounds in timed.items()}
    return {"model": name, "params_m": sum(p.numel() for p in base.parameters()) / 1e6, "rate": rate,
            "rounds": {layout: [1 / statistics.median(steps) for steps in rounds] for layout, rounds in timed.items()},
            "ratio": rate["channels_last"] / rate["contiguous"]}


def to_markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The results table."""
    return "\n".join([
        f"{args.device}, {args.precision}, batch {args.batch_size}, {args.image_size}x{args.image_size}, "
        f"{args.repeats} rounds of {args.steps} timed steps per layout", "",
        table(["model", "params (M)", "NCHW steps/s", "channels_last steps/s", "channels_last / NCHW"],
              [[row["model"], f"{row['params_m']:.1f}",
                *(f"{row['rate'][k]:.2f} ({min(row['rounds'][k]):.2f}-{max(row['rounds'][k]):.2f})"
                  for k in LAYOUTS), f"{row['ratio']:.2f}x"] for row in rows], align="lrrrr")])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = options(__doc__, models=(",".join(MODELS), "comma-separated, from: " + ", ".join(MODELS)), batch_size=8,
                     image_size=128, steps=(3, "timed steps per round and layout"),
                     repeats=(3, "rounds, alternating which layout goes first"),
                     tiny=(dict(batch_size=2, image_size=32, steps=1, repeats=1),
                           "tiny configs, batch 2 at 32 px, 1 round of 1 step"),
                     precision=(("bf16", "fp32"), None), device=(("cpu", "cuda"), None))
    args = parser.parse_args(argv)
    if unknown := [m for m in args.models.split(",") if m not in MODELS]:
        parser.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    print(f"Machine: {machine_line()}", flush=True)
    rows = []
    for name in args.models.split(","):
        rows.append(bench_model(name, args))
        print(f"{name}: {rows[-1]['ratio']:.2f}x", flush=True)
    print(to_markdown(rows, args))
    return rows


if __name__ == "__main__":
    main()

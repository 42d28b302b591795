"""Training-step throughput of torchvision models, contiguous vs channels-last, for 2-D, 3-D and 1-D models (the
method and the models: docs/benchmarks.md#models). Writes ``results.csv`` and ``results.md`` to ``--out``.

    python -m scripts.bench.models                              # all models, default sizes
    python -m scripts.bench.models --models resnet50,mobilenet_v2 --batch-size 32 --image-size 224
    python -m scripts.bench.models --models r3d_18,mc3_18,r2plus1d_18,s3d,m5
    python -m scripts.bench.models --device cuda --models resnet50 --batch-size 256
    python -m scripts.bench.models --quick --models tinycnn,r3d_18,m5 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from cltrain.model_names import UnknownModelError, build_untrained_model, closest_model_names, model_source
from cltrain.timing.layouts import choose_layout
from scripts.harness import (LAYOUTS, layout_steps, machine_line, options, random_batches, table, time_steps,
                             write_report)

#: The 16 models of PyTorch's channels_last tutorial, three newer convnets, vit_b_16 as a non-convolutional control.
IMAGE_MODELS = ["alexnet", "densenet121", "googlenet", "mnasnet1_0", "mobilenet_v2", "resnet18", "resnet34", "resnet50",
                "resnet101", "resnet152", "resnext50_32x4d", "shufflenet_v2_x1_0", "squeezenet1_1", "vgg11", "vgg16",
                "wide_resnet50_2", "convnext_tiny", "efficientnet_b0", "regnet_y_400mf", "vit_b_16"]
VIDEO_MODELS = ["r3d_18", "mc3_18", "r2plus1d_18", "s3d"]
AUDIO_MODELS = ["m5"]
ALL_MODELS = IMAGE_MODELS + VIDEO_MODELS + AUDIO_MODELS
NUM_CLASSES = 1000
#: kind -> (heading, what one sample is, the channels-last layout's name)
KINDS = {
    "image": ("Images, 4-D (N, 3, H, W)", "img", "channels_last"),
    "video": ("Video clips, 5-D (N, 3, T, H, W)", "clips", "channels_last_3d"),
    "audio": ("Audio, 1-D (N, 1, L): channels-last-1-D strides (C*L, 1, C), stock PyTorch", "clips",
              "channels-last-1-D"),
}
#: The defaults per device, and ``--quick``'s sizes (a field given on the command line wins).
SIZES = {"cpu": dict(batch_size=16, image_size=160, clip_batch_size=4, frames=8, clip_size=112, audio_batch_size=16,
                     audio_length=16000, warmup=1, auto_steps=2),
         "cuda": dict(batch_size=256, image_size=224, clip_batch_size=16, frames=16, clip_size=112,
                      audio_batch_size=128, audio_length=16000, warmup=5, auto_steps=0),
         "quick": dict(batch_size=2, image_size=64, clip_batch_size=2, frames=4, clip_size=32, audio_batch_size=2,
                       audio_length=8000)}
MAX_STEPS = 1000  #: timed steps per round, at most


def tinycnn(num_classes: int = NUM_CLASSES) -> nn.Module:
    """A four-layer convnet for tests and smoke runs."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes),
    )


def m5(num_classes: int = NUM_CLASSES, channels: int = 32) -> nn.Module:
    """M5 (Dai et al., "Very deep convolutional neural networks for raw waveforms", 2017), as in
    torchaudio's speech-command tutorial: four Conv1d/BatchNorm1d/ReLU/MaxPool1d blocks on a raw waveform."""
    def block(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
        return [nn.Conv1d(cin, cout, kernel, stride=stride), nn.BatchNorm1d(cout), nn.ReLU(inplace=True),
                nn.MaxPool1d(4)]

    return nn.Sequential(*block(1, channels, 80, stride=16), *block(channels, channels, 3),
                         *block(channels, 2 * channels, 3), *block(2 * channels, 2 * channels, 3),
                         nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(2 * channels, num_classes))


def kind_of(name: str) -> str:
    """``"image"``, ``"video"`` or ``"audio"``: what model ``name`` is timed on."""
    return "video" if name in VIDEO_MODELS else "audio" if name in AUDIO_MODELS else "image"


#: What :func:`build_model` builds itself; every other name is torchvision's or timm's.
OWN_MODELS = ("tinycnn", "m5", "vit_s_16", "unet_resnet18")


def build_model(name: str, size: int = 224, classes: int = NUM_CLASSES) -> nn.Module:
    """The model ``name`` with random weights for ``size`` px inputs, the one builder of the benchmarks: ``tinycnn``,
    ``m5``, ``vit_s_16`` (a ViT-S/16 of torchvision's ``VisionTransformer``), ``unet_resnet18``
    (segmentation_models_pytorch's U-Net, one output channel), else ``cltrain.model_names.build_untrained_model`` (a
    ViT at ``size``; GoogLeNet without its aux heads: the step trains the main head only, as in eval)."""
    if name in ("tinycnn", "m5"):
        return (tinycnn if name == "tinycnn" else m5)(classes)
    if name == "vit_s_16":
        return torchvision.models.VisionTransformer(image_size=size, patch_size=16, num_layers=12, num_heads=6,
                                                    hidden_dim=384, mlp_dim=1536, num_classes=classes)
    if name == "unet_resnet18":
        import segmentation_models_pytorch as smp

        return smp.Unet(encoder_name="resnet18", encoder_weights=None, classes=1)
    extra = {"image_size": size} if name.startswith("vit_") else {}
    return build_untrained_model(name, classes, **({"aux_logits": False, "init_weights": True} if name == "googlenet"
                                                   else extra))


def unknown_model(names: list[str]) -> str | None:
    """The first of ``names`` that :func:`build_model` cannot build, with the closest names, as one line; ``None``."""
    for name in names:
        if name not in OWN_MODELS and model_source(name) is None:
            return f"--models {UnknownModelError(name, 'auto', *closest_model_names(name))}"  # the app's own line
    return None


def input_shape(name: str, args: argparse.Namespace) -> tuple[tuple[int, ...], str]:
    """The batch shape ``name`` is timed on, and a note when it differs from the defaults."""
    kind = kind_of(name)
    if kind == "audio":
        return (args.audio_batch_size, 1, args.audio_length), ""
    if kind == "video":
        frames, size = args.frames, args.clip_size
        if name == "s3d" and (frames < 16 or size < 224):  # its AvgPool3d((2, 7, 7)) needs 16x224x224
            return (args.clip_batch_size, 3, max(frames, 16), max(size, 224), max(size, 224)), "needs >= 16x224x224"
        return (args.clip_batch_size, 3, frames, size, size), ""
    return (args.batch_size, 3, args.image_size, args.image_size), ""


def _sig(value: float) -> float:
    return float(f"{value:.4g}")  # four significant digits: slow 3-D/1-D cells run below 1 sample/s on a CPU


def bench_model(name: str, args: argparse.Namespace, device: torch.device, machine: str) -> list[dict]:
    """Both layouts' training steps (forward, cross-entropy, backward, SGD) on one random batch, timed in
    interleaved rounds, a row per dtype."""
    torch.manual_seed(0)
    base = build_model(name, args.image_size).to(device).train()
    shape, shape_note = input_shape(name, args)
    note = "; ".join(n for n in ("no aux heads" if name == "googlenet" else "", shape_note) if n)
    ((x, y),) = random_batches(1, shape, device=device)
    rows = []
    amp = (torch.float16, "fp16") if device.type == "cuda" else (torch.bfloat16, "bf16")
    for dtype, label in [(None, "fp32") if d == "fp32" else amp for d in args.dtypes]:
        steps = layout_steps(
            base, x, targets=y, device=device, autocast_dtype=dtype,
            loss=lambda out, y: F.cross_entropy((out if isinstance(out, torch.Tensor) else out[0]).float(), y),
            optimizer=lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=1e-4))
        timing = time_steps(steps, rounds=args.repeats, warmup=args.warmup, min_steps=args.steps,
                            min_window=args.min_window, max_steps=MAX_STEPS, sync=device)
        rates, steps = timing.rates(units=shape[0]), timing.steps["contiguous"]
        med = {layout: rates[layout].median for layout in LAYOUTS}
        shown = {layout: _sig(med[layout]) for layout in LAYOUTS}
        # the winner as the table shows the rates: where they round alike, the default layout
        winner = "channels_last" if shown["channels_last"] > shown["contiguous"] else "contiguous"
        pick, seconds = "n/a", None
        with contextlib.suppress(ValueError):  # a rank choose_layout does not time
            if args.auto_steps > 0:
                pick, seconds = choose_layout(base, shape, steps=args.auto_steps, warmup=1, device=device,
                                              autocast_dtype=dtype)
        rows.append({  # the columns of results.csv, in order
            "model": name, "kind": kind_of(name), "dtype": label, "batch_size": shape[0],
            "input_shape": "x".join(map(str, shape)), "device": device.type, "machine": machine, "steps": steps,
            **{f"{layout}_{k}": _sig(v) for layout, r in rates.items()
               for k, v in (("img_s", r.median), ("min", r.low), ("max", r.high))},
            "speedup": round(med["channels_last"] / med["contiguous"], 3),
            "measured_winner": winner, "auto_pick": pick,
            **{f"auto_{layout}_ms": round(1e3 * seconds[layout], 1) if seconds else "" for layout in LAYOUTS},
            "auto_matches": pick == winner if seconds else "", "note": note,
        })
        verdict = "n/a" if not seconds else "matches" if pick == winner else "differs"
        print(f"  {name:20s} {label:5s} {rows[-1]['input_shape']:>16s} x{steps:<4d} "
              f"contiguous {med['contiguous']:8.2f}/s  channels-last {med['channels_last']:8.2f}/s  "
              f"x{rows[-1]['speedup']:.2f}  auto -> {pick} ({verdict})", flush=True)
    return rows


def _cell(row: dict, layout: str) -> str:
    digits = 1 if row[f"{layout}_min"] >= 10 else 2
    return f"{row[f'{layout}_img_s']:.{digits}f} ({row[f'{layout}_min']:.{digits}f}-{row[f'{layout}_max']:.{digits}f})"


def _matches(row: dict) -> str:
    if row["auto_matches"] == "":
        return "n/a"
    if row["auto_matches"]:
        return "yes"
    overlap = row["contiguous_min"] <= row["channels_last_max"] and row["channels_last_min"] <= row["contiguous_max"]
    return "no (spreads overlap)" if overlap else "no"


def to_markdown(rows: list[dict], machine: str, args: argparse.Namespace) -> str:
    """One table per kind (image, video, audio) present in ``rows``, under a shared preamble."""
    lines = [
        f"Training step (forward, backward, SGD step) samples/second, median (min-max) of {args.repeats} interleaved "
        f"rounds, each timing at least {args.steps} steps and {args.min_window:g} s (steps per round: `results.csv`); "
        f"speed-up = channels-last / contiguous; auto = what `cltrain.timing.layouts.choose_layout` picks "
        f"({args.auto_steps} timed forward+backward steps per layout).",
        "",
        f"Machine: {machine}",
    ]
    for kind, (heading, unit, layout_name) in KINDS.items():
        group = [r for r in rows if r["kind"] == kind]
        if group:
            lines += ["", f"#### {heading}", "", table(
                ["model", "input", "dtype", f"contiguous {unit}/s", f"{layout_name} {unit}/s", "speed-up", "auto picks",
                 "matches winner"],
                [[f"{r['model']}{f' ({n})' if (n := r['note']) else ''}", r["input_shape"], r["dtype"],
                  _cell(r, "contiguous"), _cell(r, "channels_last"), f"**{r['speedup']:.2f}x**", r["auto_pick"],
                  _matches(r)] for r in group], align="lllrrrll")]
    timed = [r for r in rows if r["auto_matches"] != ""]
    matched = sum(bool(r["auto_matches"]) for r in timed)
    lines += ["", f"Auto mode picked the measured winner in {matched} of {len(timed)} cases it timed."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options(
        __doc__, models=("all", f"comma-separated names, or 'all' (= {','.join(ALL_MODELS)}); 'tinycnn' for tests"),
        batch_size=(int, "images per batch: default 16 on CPU, 256 on CUDA"),
        image_size=(int, "default 160 on CPU, 224 on CUDA (vit_b_16 needs a multiple of 16)"),
        frames=(int, "frames per clip: default 8 on CPU, 16 on CUDA"),
        dtypes=("fp32,amp", "comma-separated from fp32, amp (amp = bf16 on CPU, fp16 on CUDA)"),
        warmup=(int, "untimed steps per layout and dtype: default 1 on CPU, 5 on CUDA"),
        steps=(2, "timed steps per round, at least"), min_window=(0.1, "seconds each timed round lasts, at least"),
        repeats=(3, "rounds per layout (layouts alternate)"),
        auto_steps=(int, "timed steps per layout for the auto-mode pick; 0: skip it (default 2 on CPU, 0 on CUDA)"),
        device=(str, "cpu or cuda (default: cuda when available)"), out=(Path("bench_out/models"), "output folder"),
        quick=(dict(warmup=1, steps=1, repeats=2, auto_steps=1, min_window=0.0),
               "check it runs: batch 2, 64x64 images, 4x32x32 clips, 8000 samples, 1 step per round, 2 rounds"))
    args = p.parse_args(argv)
    device = args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    defaults = {**SIZES["cuda" if device.type == "cuda" else "cpu"], **(SIZES["quick"] if args.quick else {})}
    vars(args).update({k: v for k, v in defaults.items() if getattr(args, k, None) is None})
    args.models = ALL_MODELS if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if bad := [d for d in args.dtypes if d not in ("fp32", "amp")]:
        p.error(f"--dtypes: {bad} not in fp32, amp")
    if not 1 <= args.steps <= MAX_STEPS or args.min_window < 0 or args.warmup < 0:
        p.error(f"--steps {args.steps}, --min-window {args.min_window}, --warmup {args.warmup}: need 1 <= steps <= "
                f"{MAX_STEPS}, min-window >= 0, warmup >= 0")
    if why := unknown_model(args.models):
        p.error(why)
    if any(m.startswith("vit_") for m in args.models) and args.image_size % 16:
        p.error(f"--image-size {args.image_size}: vit models need a multiple of 16")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = args.device
    torch.set_flush_denormal(True)  # a few SGD steps on random data must not wander into slow denormals
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as apex, timm and FFCV run; the warm-up covers the tuning
    described = machine_line(device, packages=("torch", "torchvision"))
    print(f"Machine: {described}\nimages {args.batch_size}x{args.image_size}px, clips {args.clip_batch_size}x"
          f"{args.frames}x{args.clip_size}px, waveforms {args.audio_batch_size}x{args.audio_length}, dtypes "
          f"{args.dtypes}, models {len(args.models)}, timed windows >= {args.min_window:g} s", flush=True)
    rows = []
    for name in args.models:
        rows += bench_model(name, args, device, described)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    markdown = to_markdown(rows, described, args)
    write_report(args.out / "results", markdown=markdown, csv_rows=rows)
    print(markdown)
    print(f"wrote {args.out / 'results.csv'}, {args.out / 'results.md'}")
    return rows


if __name__ == "__main__":
    main()

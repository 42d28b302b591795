"""Training-step throughput of torchvision models, contiguous (NCHW) vs channels_last (NHWC).

One training step = forward, cross-entropy loss, backward, SGD(momentum) step,
on one fixed random batch (no data loading: this measures the model). For each
model and each dtype (fp32, and the device's AMP dtype: bf16 on CPU, fp16 on
CUDA, autocast without a GradScaler), the two layouts are timed in rounds that
alternate which goes first (``--repeats`` rounds of ``--steps`` steps, after
``--warmup`` steps each); the table gives the median images/second with the
min-max spread over rounds, and the speed-up channels_last / contiguous. It
also runs :func:`cltrain.autolayout.choose_layout` (what
``ChannelsLast(mode="auto")`` does) per model and dtype and says whether it
picked the measured winner.

The models: the 16 of PyTorch's channels_last tutorial, three newer convnets
(convnext_tiny, efficientnet_b0, regnet_y_400mf) and vit_b_16 as a
non-convolutional control; ``tinycnn`` is a small test model. All are built
with ``weights=None`` (nothing is downloaded).

Defaults fit the device: on CPU batch 16 at 160x160, on CUDA batch 64 at
224x224. On a 2-core CPU all 20 models take an estimated 30-50 minutes
(resnet18 alone took 76 s on a busy machine; the rest scale with their FLOPs). ``--quick`` shrinks
everything to check the script works (batch 2 at 64x64, one step per round).

Usage::

    python scripts/bench_models.py                              # all models, default sizes
    python scripts/bench_models.py --models resnet50,mobilenet_v2 --batch-size 32 --image-size 224
    python scripts/bench_models.py --quick --models tinycnn --out /tmp/bench

Writes ``results.csv``, ``results.md`` and ``speedup.png`` to ``--out``
(default ``bench_out/models``); every output names the machine.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from cltrain.autolayout import LAYOUTS, autocast_for, choose_layout, model_in_layout, synchronize
from cltrain.layout import to_channels_last

TUTORIAL_MODELS = [
    "alexnet", "densenet121", "googlenet", "mnasnet1_0", "mobilenet_v2", "resnet18", "resnet34", "resnet50",
    "resnet101", "resnet152", "resnext50_32x4d", "shufflenet_v2_x1_0", "squeezenet1_1", "vgg11", "vgg16",
    "wide_resnet50_2",
]
NEWER_MODELS = ["convnext_tiny", "efficientnet_b0", "regnet_y_400mf"]
CONTROL_MODELS = ["vit_b_16"]
ALL_MODELS = TUTORIAL_MODELS + NEWER_MODELS + CONTROL_MODELS
NUM_CLASSES = 1000
CSV_FIELDS = [
    "model", "dtype", "batch_size", "image_size", "device", "machine",
    "contiguous_img_s", "contiguous_min", "contiguous_max", "channels_last_img_s", "channels_last_min", "channels_last_max",
    "speedup", "measured_winner", "auto_pick", "auto_contiguous_ms", "auto_channels_last_ms", "auto_matches", "note",
]


def tinycnn(num_classes: int = NUM_CLASSES) -> nn.Module:
    """A four-layer convnet for tests and smoke runs."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes),
    )


def build_model(name: str, image_size: int) -> tuple[nn.Module, str]:
    """The model ``name`` (random weights) for ``image_size`` inputs, and a note ("" if none)."""
    if name == "tinycnn":
        return tinycnn(), ""
    if name == "googlenet":  # no aux heads: the step trains the main head only, as in eval
        return torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=True), "no aux heads"
    if name.startswith("vit_"):
        return torchvision.models.get_model(name, weights=None, image_size=image_size), ""
    return torchvision.models.get_model(name, weights=None), ""


def amp_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(device: torch.device) -> str:
    """One line naming the hardware and software the figures come from."""
    parts = [f"CPU {cpu_name()} ({os.cpu_count()} logical cores, torch threads {torch.get_num_threads()})"]
    if device.type == "cpu":
        bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        parts.append(f"bf16 kernels {'yes' if bf16 else 'no (AVX512-BF16/AMX missing: bf16 runs emulated, slower)'}")
    else:
        parts.append(f"GPU {torch.cuda.get_device_name(device)}")
    parts.append(f"torch {torch.__version__}, torchvision {torchvision.__version__}, {platform.system()} {platform.release()}")
    return "; ".join(parts)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> None:
    opt.zero_grad(set_to_none=True)
    with autocast_for(device, dtype):
        out = model(x)
    logits = out if isinstance(out, torch.Tensor) else out[0]
    F.cross_entropy(logits.float(), y).backward()
    opt.step()


def bench_cell(base: nn.Module, args: argparse.Namespace, device: torch.device, dtype: torch.dtype | None) -> dict[str, list[float]]:
    """Images/second per round for each layout, timed interleaved."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen).to(device)
    y = torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=gen).to(device)
    models = {layout: model_in_layout(base, layout, device).train() for layout in LAYOUTS}
    opts = {layout: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9, weight_decay=1e-4) for layout, m in models.items()}
    inputs = {"contiguous": x.contiguous(), "channels_last": to_channels_last(x)}
    for layout in LAYOUTS:
        for _ in range(args.warmup):
            _train_step(models[layout], opts[layout], inputs[layout], y, device, dtype)
    rates: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for r in range(args.repeats):
        for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
            synchronize(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                _train_step(models[layout], opts[layout], inputs[layout], y, device, dtype)
            synchronize(device)
            rates[layout].append(args.batch_size * args.steps / (time.perf_counter() - start))
    return rates


def bench_model(name: str, args: argparse.Namespace, device: torch.device, machine: str) -> list[dict]:
    torch.manual_seed(0)
    base, note = build_model(name, args.image_size)
    base.to(device).train()
    rows = []
    for dtype_name in args.dtypes:
        dtype = None if dtype_name == "fp32" else amp_dtype(device)
        rates = bench_cell(base, args, device, dtype)
        med = {layout: statistics.median(v) for layout, v in rates.items()}
        winner = max(LAYOUTS, key=lambda layout: med[layout])
        pick, seconds = choose_layout(
            base, (args.batch_size, 3, args.image_size, args.image_size),
            steps=args.auto_steps, warmup=1, device=device, autocast_dtype=dtype,
        )
        label = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        rows.append({
            "model": name, "dtype": label, "batch_size": args.batch_size, "image_size": args.image_size, "device": device.type,
            "machine": machine,
            **{f"{layout}_img_s": round(med[layout], 2) for layout in LAYOUTS},
            **{f"{layout}_min": round(min(rates[layout]), 2) for layout in LAYOUTS},
            **{f"{layout}_max": round(max(rates[layout]), 2) for layout in LAYOUTS},
            "speedup": round(med["channels_last"] / med["contiguous"], 3),
            "measured_winner": winner, "auto_pick": pick,
            **{f"auto_{layout}_ms": round(1e3 * seconds[layout], 1) for layout in LAYOUTS},
            "auto_matches": pick == winner, "note": note,
        })
        print(f"  {name:20s} {label:8s} contiguous {med['contiguous']:8.2f} img/s  channels_last {med['channels_last']:8.2f} img/s  "
              f"x{rows[-1]['speedup']:.2f}  auto -> {pick} ({'matches' if pick == winner else 'differs'})", flush=True)
    return rows


def _cell(row: dict, layout: str) -> str:
    return f"{row[f'{layout}_img_s']:.1f} ({row[f'{layout}_min']:.1f}-{row[f'{layout}_max']:.1f})"


def _matches(row: dict) -> str:
    if row["auto_matches"]:
        return "yes"
    overlap = row["contiguous_min"] <= row["channels_last_max"] and row["channels_last_min"] <= row["contiguous_max"]
    return "no (spreads overlap)" if overlap else "no"


def to_markdown(rows: list[dict], machine: str, args: argparse.Namespace) -> str:
    lines = [
        f"Training step (forward, backward, SGD step) images/second, batch {args.batch_size}, {args.image_size}x{args.image_size}, "
        f"median (min-max) of {args.repeats} rounds x {args.steps} steps; speed-up = channels_last / contiguous; "
        f"auto = what `ChannelsLast(mode=\"auto\")` picks ({args.auto_steps} timed forward+backward steps per layout).",
        "",
        f"Machine: {machine}",
        "",
        "| model | dtype | contiguous img/s | channels_last img/s | speed-up | auto picks | matches winner |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        note = f" ({r['note']})" if r["note"] else ""
        lines.append(
            f"| {r['model']}{note} | {r['dtype']} | {_cell(r, 'contiguous')} | {_cell(r, 'channels_last')} | "
            f"**{r['speedup']:.2f}x** | {r['auto_pick']} | {_matches(r)} |"
        )
    matched = sum(r["auto_matches"] for r in rows)
    lines += ["", f"Auto mode picked the measured winner in {matched} of {len(rows)} cases."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], machine: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    width = 0.8 / len(dtypes)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(models) + 2), 4.5))
    for i, dtype in enumerate(dtypes):
        by_model = {r["model"]: r for r in rows if r["dtype"] == dtype}
        xs = [j + (i - (len(dtypes) - 1) / 2) * width for j, m in enumerate(models) if m in by_model]
        ys = [by_model[m]["speedup"] for m in models if m in by_model]
        ax.bar(xs, ys, width, label=dtype)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(models)), models, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("speed-up, channels_last / contiguous")
    ax.set_title("\n".join(textwrap.wrap(machine, 120)), fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Defaults: CPU batch 16 at 160x160, CUDA batch 64 at 224x224.")
    p.add_argument("--models", default="all", help=f"comma-separated names, or 'all' (= {','.join(ALL_MODELS)}); 'tinycnn' for tests")
    p.add_argument("--batch-size", type=int, default=None, help="default 16 on CPU, 64 on CUDA")
    p.add_argument("--image-size", type=int, default=None, help="default 160 on CPU, 224 on CUDA (vit_b_16 needs a multiple of 16)")
    p.add_argument("--dtypes", default="fp32,amp", help="comma-separated from fp32, amp (amp = bf16 on CPU, fp16 on CUDA)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per layout and dtype")
    p.add_argument("--steps", type=int, default=2, help="timed steps per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds per layout (layouts alternate)")
    p.add_argument("--auto-steps", type=int, default=2, help="timed steps per layout for the auto-mode pick")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", type=Path, default=Path("bench_out/models"), help="output folder")
    p.add_argument("--quick", action="store_true", help="check it runs: batch 2 at 64x64, 1 step per round, 2 rounds")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device = device
    if args.quick:
        args.batch_size = args.batch_size or 2
        args.image_size = args.image_size or 64
        args.warmup, args.steps, args.repeats, args.auto_steps = 1, 1, 2, 1
    args.batch_size = args.batch_size or (64 if device.type == "cuda" else 16)
    args.image_size = args.image_size or (224 if device.type == "cuda" else 160)
    args.models = ALL_MODELS if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in ("fp32", "amp")]
    if bad:
        p.error(f"--dtypes: {bad} not in fp32, amp")
    known = set(ALL_MODELS) | {"tinycnn"} | set(torchvision.models.list_models(torchvision.models))
    unknown = [m for m in args.models if m not in known]
    if unknown:
        p.error(f"--models: unknown {unknown}")
    if any(m.startswith("vit_") for m in args.models) and args.image_size % 16:
        p.error(f"--image-size {args.image_size}: vit models need a multiple of 16")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = args.device
    torch.set_flush_denormal(True)  # a few SGD steps on random data must not wander into slow denormals
    machine = describe_machine(device)
    print(f"Machine: {machine}\nbatch {args.batch_size}, image {args.image_size}, dtypes {args.dtypes}, models {len(args.models)}", flush=True)
    rows = []
    for name in args.models:
        rows += bench_model(name, args, device, machine)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    markdown = to_markdown(rows, machine, args)
    (args.out / "results.md").write_text(markdown)
    plot(rows, machine, args.out / "speedup.png")
    print(markdown)
    print(f"wrote {args.out / 'results.csv'}, {args.out / 'results.md'}, {args.out / 'speedup.png'}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])

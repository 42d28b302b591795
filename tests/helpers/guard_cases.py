"""Run by test_guardrails.py, one case per process: a native crash in a kernel is a result, not the end of the suite.

    python tests/helpers/guard_cases.py stem CIN DTYPE GUARD SIZE [conv2d|subclass [compile]]   # a RepVGG-style stem's
                                                            # gradients vs float64
    python tests/helpers/guard_cases.py conv3d GUARD                # bf16-autocast Conv3d weight gradients vs fp32
    python tests/helpers/guard_cases.py convtranspose3d GUARD       # the same, ConvTranspose3d
    python tests/helpers/guard_cases.py conv3d GUARD loop           # guarded by ChannelsLastRun told no dtype
    python tests/helpers/guard_cases.py trainer MODEL GUARD SIZE    # 2 Lightning steps, ChannelsLast vs none: grads
    python tests/helpers/guard_cases.py auto GUARD                  # ChannelsLast(mode="auto") on a stem that crashes
    python tests/helpers/guard_cases.py inprocess_auto              # the in-process timing on the same stem
    python tests/helpers/guard_cases.py ddp OUT UNION               # 2 DDP ranks, rank 1 held to AVX2: same guards?

Each prints one JSON line on success; the tests read it, or the exit status when the process died.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
warnings.filterwarnings("ignore")

from cltrain import to_channels_last  # noqa: E402
from cltrain.guardrails import apply_guardrails  # noqa: E402


class UserConv2d(nn.Conv2d):
    """A user's Conv2d subclass with its own forward (the guardrail must keep it)."""

    def forward(self, x):
        return super().forward(x)


class RepStem(nn.Module):
    """A RepVGG/MobileOne-style stem: a 3x3 and a 1x1 branch, both stride 2, on the image, then a body."""

    def __init__(self, cin: int = 3, width: int = 48, classes: int = 5, conv: type[nn.Conv2d] = nn.Conv2d):
        super().__init__()
        self.conv_kxk = nn.Conv2d(cin, width, 3, stride=2, padding=1)
        self.conv_1x1 = conv(cin, width, 1, stride=2)
        self.body = nn.Sequential(nn.ReLU(), nn.Conv2d(width, width, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.body(self.conv_kxk(x) + self.conv_1x1(x)).mean((2, 3)))


def _grads(model: nn.Module, x: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
        out = model(x)
    out.float().square().mean().backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def _errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: ||got - want|| / ||want|| (inf when not finite). The norm, not the largest element: one
    ReLU whose input sits within rounding of zero flips between correct fp32 kernels and moves single elements
    by percents (seen on repvgg_a0's last stage, 3x3 at 96 px, with batch statistics); a faulty kernel moves
    the whole tensor."""
    out = {}
    for name, w in want.items():
        g = got[name]
        out[name] = float("inf") if not bool(torch.isfinite(g).all()) else float((g - w).norm() / w.norm().clamp_min(1e-30))
    return out


def stem(cin: int, dtype: str, guard: bool, size: int, conv: str = "conv2d", compile: bool = False) -> dict:
    torch.manual_seed(0)
    model = RepStem(cin, conv=UserConv2d if conv == "subclass" else nn.Conv2d)
    x = torch.randn(8, cin, size, size)
    ref_model = RepStem(cin).double()
    ref_model.load_state_dict(model.state_dict())
    with torch.backends.mkldnn.flags(enabled=False):
        want = _grads(ref_model, x.double(), "fp32")
    to_channels_last(model)
    records = apply_guardrails(model, device="cpu", dtype=torch.bfloat16 if dtype == "bf16" else None) if guard else []
    run = torch.compile(model) if compile else model
    worst: dict[str, float] = {}
    for _ in range(4):  # the faulty kernel's results vary from call to call
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
            out = run(to_channels_last(x))
        out.float().square().mean().backward()
        errors = _errors({n: p.grad.double() for n, p in model.named_parameters()}, want)
        worst = {k: max(worst.get(k, 0.0), v) for k, v in errors.items()}
    return {"errors": worst, "guarded": [list(r.modules) for r in records], "class": type(model.conv_1x1).__name__}


def conv3d(guard: bool, transposed: bool = False, loop: bool = False) -> dict:
    torch.manual_seed(0)
    # depth 2 under a 3x3x3 kernel: the faulty case; (1, 3, 3) and deep inputs are not.
    model = nn.Sequential(nn.Conv3d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv3d(32, 32, (1, 3, 3), padding=(0, 1, 1)))
    x = torch.randn(4, 16, 2, 8, 8)
    if transposed:  # a 3-D decoder's layer, its output as shallow as its input
        model, x = nn.Sequential(nn.ConvTranspose3d(64, 64, 3, padding=1)), torch.randn(4, 64, 2, 8, 8)
    want = _grads(model, x, "fp32")  # fp32 oneDNN is correct for these shapes (a float64 check agrees to 1e-7)
    if loop:  # a loop's door told no dtype (Fabric's bf16-mixed, its own torch.autocast): what does it guard?
        from cltrain.guardrails import guard_of
        from cltrain.loops import ChannelsLastRun

        run = ChannelsLastRun(model, torch.optim.SGD(model.parameters(), lr=0.1), guard=guard, layout="channels_last")
        records = run.guardrails or []  # recorded as the guards told a dtype are
        assert [list(r.modules) for r in records] == ([[n for n, m in model.named_modules() if guard_of(m)]]
                                                      if guard else []), records
    else:
        records = apply_guardrails(model, device="cpu", dtype=torch.bfloat16) if guard else []
    worst: dict[str, float] = {}
    for _ in range(3):
        errors = _errors(_grads(model, x, "bf16"), want)
        worst = {k: max(worst.get(k, 0.0), v) for k, v in errors.items()}
    return {"errors": worst, "guarded": [list(r.modules) for r in records]}


def trainer(name: str, guard: bool, size: int) -> dict:
    """Two training steps three ways: float64 NCHW with oneDNN off (the reference), fp32 NCHW, and fp32 under
    ``ChannelsLast(guard=...)``; the first step's gradients of both fp32 runs against the reference
    (BatchNorm on running statistics: see :class:`guard_models.Net`)."""
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader, TensorDataset

    from cltrain import ChannelsLast
    from guard_models import Net

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, size, size, generator=g), torch.randint(0, 5, (8,), generator=g))
    runs, records = {}, []
    for run in ("float64", "contiguous", "channels_last"):
        seed_everything(0, verbose=False)
        module = Net(name)
        callbacks = [ChannelsLast(guard=guard)] if run == "channels_last" else []
        with torch.backends.mkldnn.flags(enabled=run != "float64"):
            Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                    precision="64-true" if run == "float64" else "32-true").fit(module, DataLoader(data, batch_size=4))
        runs[run] = module
        if callbacks:
            records = [r.as_dict() for r in callbacks[0].guardrails or []]
    return {
        "contiguous": _errors(runs["contiguous"].grads, runs["float64"].grads),
        "channels_last": _errors(runs["channels_last"].grads, runs["float64"].grads),
        "guardrails": records,
        "losses": {run: m.losses for run, m in runs.items()},
    }


def auto(guard: bool) -> dict:
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from cltrain import ChannelsLast
    from guard_models import StemModule

    callback = ChannelsLast(mode="auto", input_shape=(8, 3, 96, 96), guard=guard)
    module = StemModule()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 96, 96, generator=g), torch.randint(0, 5, (8,), generator=g))
    Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[callback]).fit(module, DataLoader(data, batch_size=8))
    return {"layout": callback.layout, "failure": callback.auto_failure, "timings": callback.timings,
            "guardrails": [r.as_dict() for r in callback.guardrails or []]}


def inprocess_auto() -> dict:
    from cltrain.timing.layouts import choose_layout

    layout, timings = choose_layout(nn.Conv2d(3, 48, 1, stride=2), (8, 3, 96, 96), steps=3)
    return {"layout": layout, "timings": timings}


def ddp(out: str, union: bool) -> dict:
    """Two gloo ranks; rank 1 runs oneDNN at AVX2 (block 8), so only rank 0 (AVX-512, block 16) finds the
    8-channel 1x1 stride-2 conv hazardous. Each rank writes what it guarded and its parameter strides."""
    import os

    if os.environ.get("LOCAL_RANK") == "1":
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"  # before oneDNN's first use in this process
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from cltrain import ChannelsLast
    from guard_models import EightChannelStem

    callback = ChannelsLast()
    if not union:  # the negative control: each rank guards only what it finds itself
        import cltrain.session

        cltrain.session.hazards_over_ranks = lambda model, found, total: found
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 8, 32, 32, generator=g), torch.randint(0, 5, (16,), generator=g))
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[callback])
    module = EightChannelStem()
    trainer.fit(module, DataLoader(data, batch_size=4))
    result = {"rank": trainer.global_rank, "guarded": [list(r.modules) for r in callback.guardrails or []],
              "strides": {n: list(p.stride()) for n, p in module.named_parameters() if p.dim() == 4}}
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    return result


def main(argv: list[str]) -> None:
    case, *args = argv
    flag = lambda s: s == "1"  # noqa: E731
    if case == "stem":
        result = stem(int(args[0]), args[1], flag(args[2]), int(args[3]), *args[4:5], compile="compile" in args[5:])
    elif case in ("conv3d", "convtranspose3d"):
        result = conv3d(flag(args[0]), transposed=case == "convtranspose3d", loop="loop" in args[1:])
    elif case == "trainer":
        result = trainer(args[0], flag(args[1]), int(args[2]))
    elif case == "auto":
        result = auto(flag(args[0]))
    elif case == "inprocess_auto":
        result = inprocess_auto()
    elif case == "ddp":
        result = ddp(args[0], flag(args[1]))
    else:
        raise SystemExit(f"guard_cases.py: unknown case {case!r}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

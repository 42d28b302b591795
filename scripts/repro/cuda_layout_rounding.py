"""How far each convolution of ResNet-50 is from a float64 reference, in NCHW and in channels_last, per precision.

The first-batch check compares a step in the two layouts against the noise of an NCHW run whose module outputs
are perturbed by a few units in the last place of their dtype. On CUDA a float32 convolution computes in TF32 by
default (``torch.backends.cudnn.allow_tf32``), about 1000 times coarser than float32, so the two layouts' cuDNN
algorithms differ by more than that noise. This prints, for each precision (float32 with and without TF32, bf16
and fp16 autocast) and layout, the largest relative error of any convolution's output and weight gradient
against the float64 run of the same step, and the convolutions where the two layouts are furthest apart;
then the check's verdict on the same model (it compares in full float32 whatever the TF32 setting) with a
fused SGD whose momentum buffers start channels_last, and with AdamW, at 224 and 112 px.

    python -m scripts.repro.cuda_layout_rounding                         # CUDA: ResNet-50, 4 samples, 224 px
    python -m scripts.repro.cuda_layout_rounding --device cpu --size 64  # the same on the CPU
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from cltrain.layout import to_channels_last
from cltrain.precision import autocast_for
from cltrain.timing.clock import Stopwatch
from cltrain.timing.machine import machine, machine_line
from scripts.harness import options


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def conv_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None,
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every Conv2d's output and weight gradient (float64, NCHW) after one forward and backward."""
    outs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda m, i, o, n=n: outs.__setitem__(n, o.detach().double().contiguous()))
               for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    with autocast_for(x.device, dtype):
        loss = F.cross_entropy(model(x).double(), y)
    loss.backward()
    for h in handles:
        h.remove()
    grads = {n: m.weight.grad.double().contiguous() for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    return outs, grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-300))


def main(argv: list[str] | None = None) -> int:
    args = options(__doc__, device="cuda", batch=4, size=224, no_check=(False, "skip the check's verdicts")).parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    base = torchvision.models.resnet50(num_classes=10).to(device)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    print(machine_line(machine(device, packages=("torch", "torchvision"))))
    ref_out, ref_grad = conv_step(copy.deepcopy(base).double(), x.double(), y, None)
    precisions = [("fp32 tf32", None, True), ("fp32 strict", None, False), ("bf16", torch.bfloat16, False),
                  ("fp16", torch.float16, False)] if device.type == "cuda" else [("fp32", None, False),
                                                                                ("bf16", torch.bfloat16, False)]
    for name, dtype, allow in precisions:
        errs = {}
        for layout in ("nchw", "cl"):
            model = copy.deepcopy(base)
            xin = x
            if layout == "cl":
                to_channels_last(model)
                xin = to_channels_last(x.clone())
            with tf32(allow):
                outs, grads = conv_step(model, xin, y, dtype)
            errs[layout] = ({n: rel(o, ref_out[n]) for n, o in outs.items()},
                            {n: rel(g, ref_grad[n]) for n, g in grads.items()})
        for i, what in enumerate(("output", "weight grad")):
            nchw, cl = errs["nchw"][i], errs["cl"][i]
            apart = sorted(nchw, key=lambda n: -(cl[n] / max(nchw[n], 1e-12)))[:3]
            print(f"{name:12s} {what:11s} max error nchw {max(nchw.values()):.2e} ({max(nchw, key=nchw.get)}), "
                  f"cl {max(cl.values()):.2e} ({max(cl, key=cl.get)}); cl/nchw furthest: "
                  + ", ".join(f"{n} {cl[n]:.1e}/{nchw[n]:.1e}" for n in apart), flush=True)
        for n in ("layer3.3.conv3", "layer4.2.conv1"):
            print(f"{name:12s} {n}: output nchw {errs['nchw'][0][n]:.2e} cl {errs['cl'][0][n]:.2e}; "
                  f"weight grad nchw {errs['nchw'][1][n]:.2e} cl {errs['cl'][1][n]:.2e}")
    if args.no_check:
        return 0
    from cltrain.loops import verify_layout
    from cltrain.precision import zero_momentum_buffers

    def fused_sgd(params: object) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=device.type == "cuda")
        zero_momentum_buffers(opt)  # what the app does under loss scaling: channels_last buffers before step 0
        return opt

    for size in sorted({args.size, 112}, reverse=True):
        xs = torch.randn(args.batch, 3, size, size, device=device)
        for name, make in (("SGD fused, zero buffers", fused_sgd),
                           ("AdamW", lambda params: torch.optim.AdamW(params, lr=1e-3))):
            model = to_channels_last(copy.deepcopy(base))
            opt = make(model.parameters())
            with Stopwatch() as watch:
                result = verify_layout(model, (to_channels_last(xs.clone()), y),
                                       lambda m, b: F.cross_entropy(m(b[0]), b[1]), optimizer=opt, report=False)
            print(f"check at {size} px, {name}, tf32 {torch.backends.cudnn.allow_tf32}: {result.line()} "
                  f"[worst {result.worst}] ({watch.seconds:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

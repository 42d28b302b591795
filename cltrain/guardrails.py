"""Known-bad backend kernels that a channels_last (or bf16) model can walk into, and the targeted workaround for each.

One table, ``KNOWN_FAULTS``: for each fault the backend, the versions it is known in, the platform
condition (device, CPU architecture, ISA: a ``cltrain.platform.Platform``), the op pattern (a
predicate on a module), a one-line description naming the upstream issue, and the workaround.
``find_hazards`` lists the modules of a model that match an entry on this platform;
``apply_guardrails`` applies each entry's workaround to exactly those modules (the rest of the
model keeps its layout and dtype) and returns what it did.
``ChannelsLast`` calls it at setup; outside Lightning call it once the model is converted::

    >>> import torch
    >>> from cltrain import to_channels_last
    >>> from cltrain.guardrails import apply_guardrails
    >>> stem = torch.nn.Sequential(torch.nn.Conv2d(3, 48, 1, stride=2), torch.nn.Conv2d(48, 48, 3))
    >>> records = apply_guardrails(to_channels_last(stem), device="cpu")
    >>> [r.modules for r in records if r.fault == "onednn-1x1-strided-few-channels"] in ([("0",)], [])
    True

The workarounds are a module-level ``Conv2d`` subclass (``SubsampledConv2d``) and forward hooks made
of module-level functions, so a guarded model still deep-copies, pickles (``torch.save`` of the whole
module, loaded where ``cltrain`` is importable) and exports; ``state_dict`` keys and values are unchanged.
The NCHW-weight fallback for ``Conv2d`` subclasses is undone by converting the model again: call
``apply_guardrails`` after any conversion.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cltrain.layout import nchw
from cltrain.options import check_device, check_dtype

from cltrain.platform import Platform, current_platform

# Platform and current_platform live in cltrain.platform; importing them from here keeps working.
__all__ = [
    "GuardRecord",
    "KNOWN_FAULTS",
    "KnownFault",
    "SubsampledConv2d",
    "apply_guardrails",
    "find_hazards",
    "hazards_over_ranks",
    "guard_of",
]


# ---- the workarounds (module-level functions: a guarded model still pickles) ---------------------------------


def _nchw_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook: the conv's input in canonical NCHW strides (oneDNN then takes its blocked path)."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() in (4, 5):
        return (nchw(args[0]), *args[1:])
    return None


def _keep_weight_nchw(module: nn.Module) -> None:
    if isinstance(module.weight, nn.parameter.UninitializedParameter):
        return  # materialized later, in NCHW
    module.weight.data = nchw(module.weight.data)
    if module.weight.grad is not None:
        module.weight.grad = nchw(module.weight.grad)


class SubsampledConv2d(nn.Conv2d):
    """A 1x1 ``Conv2d`` with stride > 1 computed as a stride-1 1x1 convolution of its input's strided slice.

    The same numbers as ``nn.Conv2d`` (a 1x1 kernel without zero padding reads exactly the pixels
    ``x[..., ::sh, ::sw]``), the same parameters and ``state_dict``, any layout; oneDNN's strided 1x1
    backward (oneDNN #6035) is never called, in eager mode or under ``torch.compile``.
    ``apply_guardrails`` gives matching ``nn.Conv2d`` modules this class.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.padding_mode != "zeros":
            input = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
        input = input[..., :: self.stride[0], :: self.stride[1]]
        return F.conv2d(input, self.weight, self.bias, 1, 0, self.dilation, self.groups)


def _guard_1x1(module: nn.Module) -> None:
    if type(module) is nn.Conv2d:
        module.__class__ = SubsampledConv2d
    elif not isinstance(module, SubsampledConv2d):
        # A subclass has its own forward, which must run: keep this conv's weight and input in NCHW instead
        # (oneDNN's blocked path). Inductor may re-layout the input under torch.compile.
        _keep_weight_nchw(module)
        _register_once(module, "pre", _nchw_input)


_autocast_state = threading.local()


def _depth_below_kernel(module: nn.Module, x: Any) -> bool:
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return False
    kernel_depth = (module.kernel_size[0] - 1) * module.dilation[0] + 1
    depth = x.shape[2]
    if isinstance(module, nn.ConvTranspose3d):  # its weight gradient is a Conv3d's over its output: that depth too
        padding = module.padding[0] if isinstance(module.padding, tuple) else 0
        depth = min(depth, (depth - 1) * module.stride[0] - 2 * padding + kernel_depth + module.output_padding[0])
    return depth < kernel_depth


def _fp32_pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook: run this Conv3d in float32 when CPU autocast would run it in bf16 on an input
    shallower than its kernel (the faulty case; deeper inputs keep bf16)."""
    stack = _autocast_state.__dict__.setdefault("stack", [])
    weight = getattr(module, "weight", None)
    active = (
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and weight is not None and weight.dtype == torch.float32 and bool(args) and _depth_below_kernel(module, args[0])
    )
    stack.append(active)
    if not active:
        return None
    torch.set_autocast_enabled("cpu", False)
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _fp32_post(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """Forward hook (always called, also when forward raises): turn CPU autocast back on."""
    stack = _autocast_state.__dict__.setdefault("stack", [])
    if stack and stack.pop():
        torch.set_autocast_enabled("cpu", True)


def _guard_fp32(module: nn.Module) -> None:
    _register_once(module, "pre", _fp32_pre)
    _register_once(module, "post", _fp32_post)


def _register_once(module: nn.Module, kind: str, hook: Callable) -> None:
    hooks = module._forward_pre_hooks if kind == "pre" else module._forward_hooks
    if any(h is hook for h in hooks.values()):
        return
    if kind == "pre":
        module.register_forward_pre_hook(hook)
    else:
        module.register_forward_hook(hook, always_call=True)


# ---- the table -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KnownFault:
    """One known-bad kernel: where it is, what triggers it, and what avoids it.

    Attributes:
        key: a short stable name (``metrics.json``, logs, tests).
        backend: the library the kernel is in.
        upstream: the public issue.
        versions: the versions it is known in, and how far the table guards (a sentence).
        description: what goes wrong, in one line.
        workaround: what ``apply_guardrails`` does to a matching module, in one line.
        layouts: the model layouts (``"channels_last"``, ``"contiguous"``) in which the fault can happen.
        affects: ``(platform, dtype) -> bool``: the fault can happen on this platform for convolutions
            computed in ``dtype`` (``None``: the parameters' dtype).
        matches: ``(module, platform) -> bool``: the op pattern.
        fix: applies the workaround to one matching module, in place (idempotent).
    """

    key: str
    backend: str
    upstream: str
    versions: str
    description: str
    workaround: str
    layouts: tuple[str, ...]
    affects: Callable[[Platform, torch.dtype | None], bool]
    matches: Callable[[nn.Module, Platform], bool]
    fix: Callable[[nn.Module], None]


def _onednn_cpu_x86(p: Platform) -> bool:
    return p.device_type == "cpu" and p.onednn_version is not None and p.onednn_isa != "other"


def _is_1x1_strided_few_channels(module: nn.Module, p: Platform) -> bool:
    # Grouped, zero-padded and 3-D 1x1 convs run other oneDNN implementations (jit, gemm), measured correct.
    if not isinstance(module, nn.Conv2d) or module.groups != 1 or not _kernel_1_strided(module):
        return False
    unpadded = module.padding == "valid" or module.padding_mode != "zeros" or not any(module.padding)
    if not unpadded:
        return False
    if isinstance(module.weight, nn.parameter.UninitializedParameter):
        return True  # a lazy conv: its input channels are not known yet
    return module.in_channels < p.channel_block


def _kernel_1_strided(module: nn.Module) -> bool:
    return all(k == 1 for k in module.kernel_size) and any(s > 1 for s in module.stride)


def _is_conv3d_deep_kernel(module: nn.Module, p: Platform) -> bool:
    return isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)) and (module.kernel_size[0] - 1) * module.dilation[0] + 1 > 1


#: Every known fault the guardrails cover, one entry each.
KNOWN_FAULTS: tuple[KnownFault, ...] = (
    KnownFault(
        key="onednn-1x1-strided-few-channels",
        backend="oneDNN (CPU, x86 jit_1x1 backward-weights)",
        upstream="oneDNN #6035",
        versions="measured in oneDNN 3.12.0 (torch 2.13.0 and 2.14.1); open upstream with no fixed release, so "
                 "every oneDNN version is guarded",
        description="backward of an ungrouped, unpadded 1x1 Conv2d with stride > 1 on a channels_last input "
                    "with fewer input channels than oneDNN's channel block (16 on AVX-512, 8 on AVX2) writes past "
                    "its workspace: segfault, hang or silently wrong weight gradients, fp32 and bf16",
        workaround="computed as a stride-1 1x1 conv of the input's strided slice (SubsampledConv2d: the same numbers "
                   "and parameters, layouts unchanged); a Conv2d subclass keeps its forward, with its weight and "
                   "input in NCHW instead",
        layouts=("channels_last",),
        affects=lambda p, dtype: _onednn_cpu_x86(p),
        matches=_is_1x1_strided_few_channels,
        fix=_guard_1x1,
    ),
    KnownFault(
        key="onednn-bf16-conv3d-weight-grad",
        backend="oneDNN (CPU, x86 jit_bf16 Conv3d backward-weights)",
        upstream="no upstream report yet (scripts/repro/cpu_bf16_conv3d_grad.py)",
        versions="measured in oneDNN 3.12.0 (torch 2.14.1) with AVX-512 (not with AVX2); every oneDNN version "
                 "and x86 ISA is guarded",
        description="bf16 Conv3d weight gradients are wrong (up to 1e37) or not finite when the input is "
                    "shallower than the kernel (depth 2 under a 3x3x3 kernel, 2-4 under 5x3x3; depth 1 with a "
                    "large depth padding), some of those a heap corruption (a crash), "
                    "in both layouts, on AVX-512; a ConvTranspose3d's too, where its input or output is",
        workaround="under bf16 autocast, a Conv3d (or ConvTranspose3d) whose input (or a transposed one's output) "
                   "is shallower than its kernel is computed in float32 "
                   "(autocast off for that call); deeper inputs keep bf16; bf16 weights (bf16-true) are not covered",
        layouts=("channels_last", "contiguous"),
        affects=lambda p, dtype: _onednn_cpu_x86(p) and dtype == torch.bfloat16,
        matches=_is_conv3d_deep_kernel,
        fix=_guard_fp32,
    ),
)


# ---- finding and fixing --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GuardRecord:
    """What ``apply_guardrails`` did for one fault.

    Attributes:
        fault: the ``KnownFault.key``.
        upstream: the public issue.
        modules: the qualified names of the modules it changed (``""`` is the model itself).
        action: the workaround, in one line.
        description: the fault, in one line.
    """

    fault: str
    upstream: str
    modules: tuple[str, ...]
    action: str
    description: str

    def line(self, limit: int = 4) -> str:
        """One log line: the fault, the modules (the first ``limit``), and what was done."""
        names = ", ".join(n or "<model>" for n in self.modules[:limit])
        more = f" and {len(self.modules) - limit} more" if len(self.modules) > limit else ""
        return f"{self.upstream} ({self.fault}): {len(self.modules)} module(s) [{names}{more}]: {self.action}"

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for ``metrics.json``."""
        return {"fault": self.fault, "upstream": self.upstream, "modules": list(self.modules), "action": self.action}


def find_hazards(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    layout: str = "channels_last",
    faults: tuple[KnownFault, ...] = KNOWN_FAULTS,
) -> dict[str, list[str]]:
    """The modules of ``model`` that match a known fault on this platform.

    Args:
        model: the model, as it will be trained.
        device: where it will train (default: where its parameters are).
        dtype: the dtype its convolutions compute in: the autocast dtype (``torch.bfloat16`` for CPU
            ``bf16-mixed``), or the parameters' dtype when they are cast (``bf16-true``); ``None`` for fp32.
        layout: the layout it trains in, ``"channels_last"`` or ``"contiguous"``.
        faults: the table to check (default ``KNOWN_FAULTS``).

    Returns:
        ``{fault key: [qualified module names]}``, only the faults with a match.

    Raises:
        ValueError: ``layout`` is not ``"channels_last"`` or ``"contiguous"``.
    """
    if layout not in ("channels_last", "contiguous"):
        raise ValueError(f"find_hazards: layout={layout!r} is not 'channels_last' or 'contiguous'.")
    plat = current_platform(device, model)
    found: dict[str, list[str]] = {}
    for fault in faults:
        if layout not in fault.layouts or not fault.affects(plat, dtype):
            continue
        names = [name for name, module in model.named_modules() if fault.matches(module, plat)]
        if names:
            found[fault.key] = names
    return found


def hazards_over_ranks(model: nn.Module, found: dict[str, list[str]],
                       sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, list[str]]:
    """``found`` (``find_hazards`` on this rank) united with every other rank's: the oneDNN ISA, so the channel block,
    can differ between machines, and every rank must guard the same modules for its parameters to keep the layouts
    the others' do (DDP's buckets). ``sum_over_ranks`` sums a float tensor over the ranks (an all-reduce); every rank
    calls this at the same point."""
    names = [name for name, _ in model.named_modules()]
    index = {name: j for j, name in enumerate(names)}
    flags = torch.zeros(len(KNOWN_FAULTS), len(names))
    for i, fault in enumerate(KNOWN_FAULTS):
        for name in found.get(fault.key, ()):
            flags[i, index[name]] = 1
    flags = sum_over_ranks(flags).cpu()
    union = {fault.key: [names[j] for j in flags[i].nonzero().flatten().tolist()]
             for i, fault in enumerate(KNOWN_FAULTS)}
    return {key: modules for key, modules in union.items() if modules}


def apply_guardrails(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    layout: str = "channels_last",
    faults: tuple[KnownFault, ...] = KNOWN_FAULTS,
    hazards: dict[str, list[str]] | None = None,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[GuardRecord]:
    """Apply each known fault's workaround to the modules of ``model`` that match it, in place.

    Call it after the model is converted (its layout decided) and before it is wrapped (DDP) or compiled.
    Calling it again is harmless (the hooks are registered once); it is needed again after any later
    conversion of the model's weights.

    Args:
        model: the model to guard.
        device: as for ``find_hazards``.
        dtype: as for ``find_hazards``.
        layout: as for ``find_hazards``.
        faults: as for ``find_hazards``.
        hazards: the modules to guard, as ``find_hazards`` returns them (default: what it finds on
            this process's platform).
        sum_over_ranks: in distributed training, a sum over the ranks (an all-reduce; every rank calls
            ``apply_guardrails`` at the same point): ``hazards`` are then united with every other rank's
            (``hazards_over_ranks``), so that every rank's parameters keep the same layouts.

    Returns:
        One ``GuardRecord`` per fault that matched (an empty list: nothing to do here).

    Raises:
        ValueError: ``layout`` is not ``"channels_last"`` or ``"contiguous"``, or a ``dtype`` or ``device`` that is
            not torch's.

    Example::

        >>> import torch
        >>> model = torch.nn.Conv3d(8, 8, 3, padding=1)
        >>> [r.fault for r in apply_guardrails(model, device="cpu", dtype=torch.bfloat16)] in (
        ...     ["onednn-bf16-conv3d-weight-grad"], [])
        True
    """
    check_dtype("apply_guardrails", "dtype", dtype)  # "bf16" would find no bf16 hazard, and say nothing
    check_device("apply_guardrails", device)
    if hazards is None:
        hazards = find_hazards(model, device=device, dtype=dtype, layout=layout, faults=faults)
    if sum_over_ranks is not None:
        hazards = hazards_over_ranks(model, hazards, sum_over_ranks)
    modules = dict(model.named_modules())
    records = []
    for fault in faults:
        names = hazards.get(fault.key)
        if not names:
            continue
        for name in names:
            fault.fix(modules[name])
        records.append(GuardRecord(fault.key, fault.upstream, tuple(names), fault.workaround, fault.description))
    return records


def arm_autocast_guards(model: nn.Module, *, device: torch.device | str | None = None) -> list[GuardRecord]:
    """The workarounds that act only under bf16 autocast, applied whatever the loop's dtype: their hooks look at the
    autocast state of each call, so a float32 step never reaches them. For a loop whose autocast cannot be seen
    (Fabric's ``bf16-mixed``, the loop's own ``torch.autocast``) and was not named."""
    records = apply_guardrails(model, device=device, dtype=torch.bfloat16,
                               faults=tuple(f for f in KNOWN_FAULTS if f.fix is _guard_fp32))
    return [dataclasses.replace(r, action=f"armed for a bf16 autocast not named: {r.action}") for r in records]


def guard_of(module: nn.Module) -> KnownFault | None:
    """The known fault whose workaround ``apply_guardrails`` gave ``module``, or ``None``."""
    pre = [h for h in module._forward_pre_hooks.values()]
    key = ("onednn-1x1-strided-few-channels" if isinstance(module, SubsampledConv2d) or _nchw_input in pre
           else "onednn-bf16-conv3d-weight-grad" if _fp32_pre in pre else None)
    return next((f for f in KNOWN_FAULTS if f.key == key), None)

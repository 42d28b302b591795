"""The front doors' arguments, checked alike: a bad one is a ``ValueError`` of one line naming the call, the argument
and what it takes, the same words from ``ChannelsLast``, ``convert_model``, the Hugging Face callback and hook and
``prepare_channels_last``.

Example::

    >>> check_flags("convert_model", guard=True, sharded="yes")
    Traceback (most recent call last):
    ...
    ValueError: convert_model(sharded='yes'): expected True or False.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from cltrain.layout.tensors import MODES

__all__ = ["check_callable", "check_copies", "check_device", "check_dtype", "check_flags", "check_layout_choice",
           "check_mode", "check_optimizers", "check_positive"]

#: What every front door's ``layout=`` takes: ``"auto"`` races the layouts on the run's own steps, the others pin one.
LAYOUT_CHOICES = ("auto", "channels_last", "contiguous")


def check_mode(call: str, mode: Any, modes: tuple[str, ...] = MODES) -> None:
    """``mode`` is one of ``modes`` (what every front door converts with, unless it adds its own)."""
    if mode == "auto":
        raise ValueError(f"{call}(mode='auto'): the layout is chosen by layout= ('auto', the default, races both "
                         f"layouts on the run's first training steps); mode takes {modes}.")
    if mode not in modes:
        raise ValueError(f"{call}(mode={mode!r}): expected one of {modes}.")


def check_layout_choice(call: str, layout: Any) -> None:
    """``layout`` is one of ``LAYOUT_CHOICES``."""
    if layout not in LAYOUT_CHOICES:
        raise ValueError(f"{call}(layout={layout!r}): expected one of {LAYOUT_CHOICES} ('auto', the default, times "
                         "both on the run's first training steps and keeps the faster).")


def check_flags(call: str, **flags: Any) -> None:
    """Each of ``flags`` is ``True`` or ``False``."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{call}({name}={value!r}): expected True or False.")


def check_positive(call: str, name: str, value: Any, whole: bool = True, optional: bool = False) -> None:
    """``value`` is an int >= 1 (``whole``) or a number of seconds > 0; ``optional``: or ``None``."""
    if optional and value is None:
        return
    if whole and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{call}({name}={value!r}): expected {'None or ' if optional else ''}an int >= 1.")
    if not whole and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"{call}({name}={value!r}): expected seconds > 0.")


def check_dtype(call: str, name: str, dtype: Any) -> None:
    """``dtype`` is an autocast dtype: ``torch.bfloat16``, ``torch.float16``, or ``None`` (float32; also
    ``torch.float32``). The guardrails depend on it: a name ("bf16") would leave the bf16 ones out."""
    import torch

    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{call}({name}={_shown(dtype)}): expected torch.bfloat16, torch.float16 or None (float32), "
                         "the dtype the loop's autocast computes in.")


def check_device(call: str, device: Any) -> None:
    """``device`` is ``None``, a ``torch.device`` or a string torch reads as one (``"cuda:0"``, ``"cpu"``)."""
    import torch

    if device is None or isinstance(device, torch.device):
        return
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{call}(device={_shown(device)}): expected a device torch knows ('cpu', 'cuda', 'cuda:0', "
                         "'mps', or a torch.device), or None for the model's own.") from None


def check_callable(call: str, takes: str, optional: bool = True, **values: Any) -> None:
    """Each of ``values`` is a function (``optional``: or ``None``); ``takes`` says what it is called with."""
    for name, value in values.items():
        if not (callable(value) or optional and value is None):
            raise ValueError(f"{call}({name}={_shown(value)}): expected {'None or ' if optional else ''}a function "
                             f"{takes}.")


def check_optimizers(call: str, optimizer: Any, several: bool = True) -> list[Any]:
    """``optimizer`` as a list: ``None``, an optimizer (anything with ``param_groups`` and a ``step``: torch's, and
    the wrappers of Fabric, Accelerate and DeepSpeed), or (``several``) an iterable of them."""
    def optimizer_like(value: Any) -> bool:
        return hasattr(value, "param_groups") and callable(getattr(value, "step", None))

    if optimizer is None:
        return []
    if optimizer_like(optimizer):
        return [optimizer]
    name, bad = "optimizer", optimizer
    if several and isinstance(optimizer, Iterable) and not isinstance(optimizer, (str, bytes, type)):
        items = list(optimizer)
        index = next((i for i, o in enumerate(items) if not optimizer_like(o)), None)
        if index is None:
            return items
        name, bad = f"optimizer[{index}]", items[index]
    takes = "an optimizer or a list of them" if several else "an optimizer"
    raise ValueError(f"{call}({name}={_shown(bad)}): expected {takes}, as the loop steps it "
                     "(torch.optim.AdamW(model.parameters()), not its name or class).")


def check_copies(call: str, copies: Any) -> Callable[[], list[Any]]:
    """``copies`` (the model's copies that follow its layout) as a function giving them: a function as it is, a
    module or a list of modules as themselves, ``None`` as none. What a function gives may hold ``None``: an EMA made
    after the door (``copies=lambda: [ema]`` while ``ema`` is still ``None``), which is no copy yet."""
    import torch.nn as nn

    modules = isinstance(copies, nn.Module) or (  # a module is callable too, but the copy itself
        isinstance(copies, (list, tuple)) and all(isinstance(c, nn.Module) for c in copies))
    if copies is None or modules or callable(copies):
        return _Copies(call, copies)
    raise ValueError(f"{call}(copies={_shown(copies)}): expected the model's copies (a module, a list of them, or a "
                     "function giving them: copies=lambda: [ema]).")


class _Copies:
    """``check_copies``' function: an object, not a closure, so that a door holding it pickles (Lightning's
    ``ddp_spawn`` pickles the Trainer's callbacks into its processes)."""

    def __init__(self, call: str, copies: Any) -> None:
        self.call, self.copies = call, copies

    def __call__(self) -> list[Any]:
        import torch.nn as nn

        copies = self.copies
        if copies is None:
            return []
        if isinstance(copies, nn.Module):
            return [copies]
        if isinstance(copies, (list, tuple)):
            return list(copies)
        found = copies()
        listed = isinstance(found, Iterable) and not isinstance(found, (nn.Module, str, bytes))
        found = list(found) if listed else [found]
        bad = next((c for c in found if c is not None and not isinstance(c, nn.Module)), None)
        if bad is not None:
            raise ValueError(f"{self.call}(copies=...): the function gave {_shown(bad)}, not a module: it should give "
                             "the model's copies (copies=lambda: [ema]).")
        return [c for c in found if c is not None]


def check_module(call: str, model: Any) -> None:
    """``model`` is a ``torch.nn.Module``; a ValueError naming ``call`` otherwise."""
    import torch.nn as nn

    several = list(model.values()) if isinstance(model, dict) else model if isinstance(model, (list, tuple)) else []
    if several and all(isinstance(m, nn.Module) for m in several):
        shown = f"<{type(model).__name__} of {len(several)} module{'s' if len(several) > 1 else ''}>"
        if len(several) == 1:
            raise ValueError(f"{call}(model={shown}): pass the module itself (a trailing comma made a tuple?).")
        fix = ", with their optimizers as a list" if call == "ChannelsLastRun" else f", or call {call} on each"
        raise ValueError(f"{call}(model={shown}): one model: put them in one torch.nn.ModuleDict({{'g': ..., "
                         f"'d': ...}}){fix}.")
    if not isinstance(model, nn.Module):
        raise ValueError(f"{call}(model={_shown(model)}): expected the model itself, a torch.nn.Module (not its name, "
                         "class or state_dict).")


def _shown(value: Any) -> str:
    """A value as a one-line message names it: its repr, or its type where the repr is long or spans lines."""
    text = repr(value)
    return text if "\n" not in text and len(text) <= 60 else f"<{type(value).__name__}>"

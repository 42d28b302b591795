"""Restride the model's inputs in a batch, in place: what ``ChannelsLast`` does to every batch.

Only the model's input is converted by default; targets, masks, heatmaps, boxes and every
other tensor keep the layout the user's code built (a loss doing ``target.view(N, -1)``
keeps working). Which tensors are the input, by the batch's shape:

* a tensor: the batch itself;
* a dict (any mapping), namedtuple or dataclass: the values under ``IMAGE_KEYS``
  (``image``, ``pixel_values``, ``inputs``, ``video``, ...); a dict with none of them
  has no input that can be told apart from its targets, and nothing is converted;
* a tuple or list (any sequence; a namedtuple without an image field): its first element,
  as in ``(input, target)``;
* inside that input (the first element, or a value under an image key), a dict,
  namedtuple or dataclass again gives its image keys (or all of it when it has none),
  and a tuple or list is several inputs (multi-crop views, multi-scale images): all of them.

``inputs=`` names others instead: a key or field name (found at any depth), an index of a
tuple or list batch, a list of those, or ``"all"`` for every tensor of the batch. Within
what is selected, only floating tensors of rank 4 and 5 (with ``one_d``, rank 3) are
converted. A callback cannot replace the batch object, so the tensors' ``.data`` is
swapped: the step sees the same tensor objects, in the new layout.

Example::

    >>> import torch
    >>> batch = {"image": torch.randn(2, 3, 8, 8), "heatmap": torch.rand(2, 5, 8, 8)}
    >>> restride_batch(batch, "channels_last"), batch["image"].stride(), batch["heatmap"].is_contiguous()
    (1, (192, 1, 24, 3), True)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Union

import torch
from torch import nn

from cltrain.layout.stacks import in_input_layout, to_input_layout
from cltrain.layout.tensors import is_channels_last_1d, to_channels_last_1d

__all__ = [
    "IMAGE_KEYS", "Inputs", "check_inputs", "describe_batch", "first_image_tensor", "image_inputs", "map_tensors",
    "model_inputs", "restore_batch", "restride_batch",
]

#: Dict keys (and namedtuple/dataclass field names) read as the model's image input: albumentations,
#: MONAI, torchgeo, anomalib, detectron2 (``image``); MMDetection 2 / MMAction (``img``, ``imgs``);
#: MMEngine (``inputs``); Hugging Face (``pixel_values``, ``pixel_values_videos``); PyTorchVideo
#: (``video``); and the generic ``images``, ``input``, ``x``, ``videos``, ``clip(s)``, ``frames``.
IMAGE_KEYS: frozenset[str] = frozenset({
    "image", "images", "img", "imgs", "pixel_values", "pixel_values_videos", "input", "inputs", "x",
    "video", "videos", "clip", "clips", "frames",
})

#: What ``inputs=`` accepts: ``None`` (the model's input, see the module docstring), ``"all"``,
#: a key or field name, an index of a tuple/list batch, or a list of keys and indices.
Inputs = Union[None, str, int, Sequence[Union[str, int]]]


def check_inputs(inputs: Any, owner: str = "") -> None | str | tuple[str | int, ...]:
    """``inputs`` in canonical form (``None``, ``"all"`` or a tuple of keys and indices).

    Raises:
        ValueError: ``inputs`` is none of the forms of ``Inputs``; the message names ``owner``
            (a class or function name) and the value.
    """
    if inputs is None or inputs == "all":
        return inputs
    items = (inputs,) if isinstance(inputs, (str, int)) else inputs
    if (
        not isinstance(items, Sequence)
        or not items
        or not all(isinstance(i, (str, int)) and not isinstance(i, bool) for i in items)
        or "all" in items and len(items) > 1
        or "" in items
    ):
        where = f"{owner}(inputs={inputs!r})" if owner else f"inputs={inputs!r}"
        raise ValueError(
            f"{where}: expected None (the model's input), 'all', a key, an index, or a list of keys and indices."
        )
    return tuple(items)


def model_inputs(batch: Any, inputs: Inputs = None) -> list[torch.Tensor]:
    """The tensors of ``batch`` that ``inputs`` selects (every rank and dtype; see the module docstring).

    Raises:
        ValueError: a key or index named in ``inputs`` is not in ``batch``.

    Example::

        >>> x, y = torch.randn(2, 3, 4, 4), torch.rand(2, 3, 4, 4)
        >>> [t is x for t in model_inputs((x, y))], len(model_inputs((x, y), "all"))
        ([True], 2)
    """
    inputs = check_inputs(inputs)
    if isinstance(batch, torch.Tensor):
        return [batch]
    if inputs == "all":
        return _tensors(batch)
    if inputs is None:
        return _default_inputs(batch)
    found: list[torch.Tensor] = []
    for selector in inputs:
        parts = _at_index(batch, selector) if isinstance(selector, int) else _under_key(batch, selector)
        for part in parts:
            found += _tensors(part)
    return found


def image_inputs(batch: Any, inputs: Inputs = None, one_d: bool = False) -> dict[int, torch.Tensor]:
    """The tensors ``restride_batch`` puts in a layout, by position: their index in ``model_inputs(batch, inputs)``
    (the same for every batch of the same structure). Floating rank-4/5 (with ``one_d``, rank-3) tensors, each once.

    Raises:
        ValueError: a key or index named in ``inputs`` is not in ``batch``.
    """
    ranks = (3, 4, 5) if one_d else (4, 5)
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    for position, t in enumerate(model_inputs(batch, inputs)):
        if id(t) in seen or t.dim() not in ranks or not t.is_floating_point() or t.layout is not torch.strided:
            continue
        seen.add(id(t))
        found[position] = t
    return found


def restride_batch(batch: Any, layout: str, one_d: bool = False, inputs: Inputs = None,
                   skip: Collection[int] = (), model: nn.Module | None = None,
                   kept: dict[int, tuple[torch.Tensor, torch.Tensor, int]] | None = None) -> int:
    """Put the floating rank-4/5 (and with ``one_d``, rank-3) tensors of ``batch`` that ``inputs``
    selects in ``layout`` (``"channels_last"`` or ``"contiguous"``), in place; returns how many
    tensors it copied (0 when they already arrive in the layout: nothing is copied then). The
    positions in ``skip`` (``image_inputs``' keys) are left as they are. A 5-D tensor is a clip or a stack
    of images by ``cltrain.layout.stacks.channel_dim`` (``model``: the model that reads it). ``kept``
    collects each changed tensor's data as it was (by ``id``, the first time only): ``restore_batch(kept)``
    puts it back.

    Raises:
        ValueError: a key or index named in ``inputs`` is not in ``batch``.
    """
    want_cl = layout == "channels_last"
    converted = 0
    for position, t in image_inputs(batch, inputs, one_d).items():
        if position in skip:
            continue
        before = t.data
        if want_cl and t.dim() == 3:
            if is_channels_last_1d(t):
                continue
            t.data = to_channels_last_1d(t.data)
        elif want_cl and not in_input_layout(t, model):
            t.data = to_input_layout(t.data, model)
        elif not want_cl and not t.is_contiguous():
            t.data = t.data.contiguous()
        else:
            continue
        if kept is not None:
            kept.setdefault(id(t), (t, before, _version_of(t)))
        converted += 1
    return converted


def _version_of(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter: its writes (under inference_mode, where no
        return -1  # backward reads them) are not given back, which would copy every evaluation batch once more


def restore_batch(kept: dict[int, tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """Give the tensors ``restride_batch`` changed their data back as it was, and empty ``kept``: a loader
    that hands out the same tensor objects again (a cached batch, a dataset already on the device) finds
    them as it made them."""
    for t, data, version in kept.values():
        if _version_of(t) != version and t.data.data_ptr() != data.data_ptr():
            # the step wrote into the input in place (a normalisation, an augmentation on the device): the values
            # it wrote go back with the data, as they would have stayed without the conversion (autograd may still
            # hold the tensor for a backward after the next batch is asked for, a window that sums its losses)
            data.copy_(t.data)
        t.data = data
    kept.clear()


def first_image_tensor(batch: Any, inputs: Inputs = None) -> torch.Tensor | None:
    """The first rank-4/5 floating tensor that ``inputs`` selects in ``batch``, or ``None``."""
    return next((t for t in model_inputs(batch, inputs) if t.dim() in (4, 5) and t.is_floating_point()), None)


def first_image_list(batch: Any, _top: bool = True) -> list[torch.Tensor] | None:
    """The first list or tuple of 3-D images (floating or ``uint8``) below ``batch`` (a detector's images), or
    ``None``. Not ``batch`` itself: ``(x, y)`` of two 3-D tensors is a batch of ``x``, not two images."""
    if not _top and _is_sequence(batch) and batch and all(
            isinstance(t, torch.Tensor) and t.dim() == 3 and (t.is_floating_point() or t.dtype == torch.uint8)
            for t in batch):
        return list(batch)
    fields = _fields(batch)
    children = fields.values() if fields is not None else batch if _is_sequence(batch) else ()
    return next((found for child in children if (found := first_image_list(child, False)) is not None), None)


# ---- the walk -----------------------------------------------------------------------------------


def _fields(obj: Any) -> dict[Any, Any] | None:
    """The named children of a mapping, namedtuple or dataclass instance; ``None`` for anything else."""
    if isinstance(obj, Mapping):
        return dict(obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return obj._asdict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return None


def _is_sequence(obj: Any) -> bool:
    return isinstance(obj, Sequence) and not isinstance(obj, (str, bytes))


def _image_values(obj: Any) -> list[Any] | None:
    fields = _fields(obj)
    if fields is None:
        return None
    return [v for k, v in fields.items() if k in IMAGE_KEYS]


def _default_inputs(batch: Any) -> list[torch.Tensor]:
    images = _image_values(batch)
    if images:
        return [t for v in images for t in _input_part(v)]
    if _is_sequence(batch) and len(batch) > 0:  # (input, target, ...), and namedtuples without an image field
        return _input_part(batch[0])
    return []  # a dict or dataclass with no image key: the input cannot be told from the targets


def _input_part(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    images = _image_values(obj)
    if images:
        return [t for v in images for t in _input_part(v)]
    if _is_sequence(obj) or images is not None:  # several inputs, or a dict of inputs with no image key
        return _tensors(obj)
    return []


def _at_index(batch: Any, index: int) -> list[Any]:
    if not _is_sequence(batch):
        raise ValueError(
            f"inputs={index!r}: an index selects from a tuple or list batch, and this batch is a "
            f"{type(batch).__name__}{_keys_hint(batch)}; name its keys instead."
        )
    if not -len(batch) <= index < len(batch):
        raise ValueError(f"inputs={index!r}: the batch has {len(batch)} elements; name an index in range.")
    return [batch[index]]


def _under_key(batch: Any, key: str) -> list[Any]:
    found: list[Any] = []
    keys: list[Any] = []

    def walk(obj: Any) -> None:
        fields = _fields(obj)
        if fields is not None:
            for k, v in fields.items():
                keys.append(k)
                if k == key:
                    found.append(v)
                else:
                    walk(v)
        elif _is_sequence(obj):
            for v in obj:
                walk(v)

    walk(batch)
    if not found:
        have = ", ".join(repr(k) for k in dict.fromkeys(keys)) or "none"
        raise ValueError(
            f"inputs={key!r}: the batch ({type(batch).__name__}) has no key or field {key!r} (its keys: {have}); "
            "name one of them, an index of a tuple/list batch, or 'all'."
        )
    return found


def _keys_hint(batch: Any) -> str:
    fields = _fields(batch)
    return f" with keys {', '.join(repr(k) for k in fields)}" if fields else ""


def _tensors(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _visit_tensors(batch, found.append)
    return found


def _visit_tensors(batch: Any, fn: Callable[[torch.Tensor], None]) -> None:
    """Call ``fn`` on every tensor of ``batch`` (tensors, mappings, sequences, namedtuples,
    dataclasses, nested), by ``map_tensors``: the batch types Lightning can move to the device
    are exactly the ones visited. The rebuilt collection it returns is dropped; ``fn`` works on
    the tensor objects the step will see."""

    def call(t: torch.Tensor) -> torch.Tensor:
        fn(t)
        return t

    map_tensors(batch, call)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], *,
                items: Callable[[list[Any]], list[Any]] | None = None, _top: bool = True) -> Any:
    """``obj`` with ``fn(t)`` in place of each tensor ``t`` in it, at any depth: mappings, sequences
    (namedtuples included) and dataclass instances are rebuilt as their own type around the new
    values; anything else (strings, numbers, other objects) is kept as it is. These are the
    collections Lightning's ``apply_to_collection`` walks to move a batch to the device, without
    importing Lightning (the layout and data layers are torch-only). ``items``, where given, picks
    the elements each list or tuple below ``obj`` (not a namedtuple) is rebuilt from.

    Example::

        >>> out = map_tensors({"image": torch.zeros(2), "name": "a", "boxes": [torch.ones(1)]}, lambda t: t + 1)
        >>> out["image"].tolist(), out["name"], out["boxes"][0].tolist()
        ([1.0, 1.0], 'a', [2.0])
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for field in dataclasses.fields(obj):
            if field.init:  # a field ``__init__`` does not take is derived state: kept, as Lightning keeps it
                # object.__setattr__, as a frozen dataclass's own __init__ sets its fields
                object.__setattr__(out, field.name, map_tensors(getattr(obj, field.name), fn, items=items, _top=False))
        # a cached_property worked out from the old tensors would be stale on the copy
        cached = getattr(out, "__dict__", {})
        for name, attr in vars(type(obj)).items():
            if isinstance(attr, functools.cached_property):
                cached.pop(name, None)
        return out
    if isinstance(obj, Mapping):
        values = {k: map_tensors(v, fn, items=items, _top=False) for k, v in obj.items()}
        return type(obj)(obj.default_factory, values) if isinstance(obj, defaultdict) else type(obj)(values)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple takes its fields as arguments
        return type(obj)(*(map_tensors(v, fn, items=items, _top=False) for v in obj))
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        values = list(obj) if items is None or _top else items(list(obj))
        return type(obj)([map_tensors(v, fn, items=items, _top=False) for v in values])
    return obj


def describe_batch(batch: Any) -> str:
    """A few words on ``batch``'s shape for a message: its type and, for a dict-like batch, its keys."""
    return f"{type(batch).__name__}{_keys_hint(batch)}"

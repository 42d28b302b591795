"""Layout audit: which operators of a model drop channels_last, and how many layout copies a step makes.

``audit_model`` runs one forward and one backward of the model under a
``TorchDispatchMode``, so it sees every ATen operator the step really
dispatches (no monkey-patching of ``torch`` functions, unlike the tutorial's
checker), and reports:

* every op with a *definitely* channels_last rank-4/5 input (one whose strides
  are not also NCHW-contiguous) whose rank-4/5 output is not laid out
  channels-last (size-1 dims ignored), with the op name, the module path (in
  backward: the module whose forward created the autograd node), the input
  and output shapes and strides, and how many times per step it happened.
  Views are marked ``view``: they copy nothing themselves, but whatever
  consumes them reads or copies NCHW-ordered memory. A view that only renames
  the dims of a whole dense tensor (``permute(0, 2, 3, 1)`` to NHWC for a
  LayerNorm, as ConvNeXt does) is not reported: its memory order is unchanged;
* layout-changing copies per step: ``clone``/``_to_copy``/``copy_`` from one
  definite layout to the other, plus the conversion a convolution makes when
  its operands (input, weight, and in backward the incoming gradient) disagree
  (counted as "implicit").

The model is left as it was: gradients, BatchNorm running statistics and
train/eval mode are restored.

Command line (a torchvision or timm model with random weights, converted to channels_last;
see ``cltrain.tools.audit``)::

    cltrain-audit resnet50 --batch-size 2 --image-size 224 [--dtype bf16] [--mode full|conv] [--device cpu]

Example::

    >>> import torch
    >>> from cltrain import to_channels_last
    >>> from cltrain.audit import audit_model
    >>> model = to_channels_last(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()))
    >>> report = audit_model(model, torch.randn(2, 3, 16, 16))
    >>> report.rows, report.layout_copies
    ([], 0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cltrain.precision import autocast_for
from cltrain.timing.steps import scalar_loss
from cltrain.layout import is_channels_last, layout_summary, to_channels_last
from cltrain.layout.function_mode import UserFrameMode

__all__ = ["AuditReport", "AuditRow", "audit_model"]

_COPY_OPS = frozenset({"aten.clone", "aten._to_copy", "aten.copy_"})
_CONV_OPS = frozenset({"aten.convolution", "aten.convolution_backward"})


@dataclass
class AuditRow:
    """One op (at one module path, in one phase, on one set of shapes) and how often it ran per step."""

    op: str
    module_path: str
    phase: str
    input_shapes: tuple[tuple[int, ...], ...]
    input_strides: tuple[tuple[int, ...], ...]
    output_shape: tuple[int, ...]
    output_stride: tuple[int, ...]
    count: int = 1
    #: ``"view"`` (aliases its input, copies nothing), ``"copy"`` or ``"compute"``.
    kind: str = "compute"


@dataclass
class AuditReport:
    """What ``audit_model`` found. ``str(report)`` is ``format_table``."""

    #: Ops whose rank-4/5 output is not channels_last although a channels_last input was.
    rows: list[AuditRow]
    #: Layout-changing copies per step (forward + backward), explicit and implicit.
    layout_copies: int
    #: Those copies, grouped like ``rows`` (``input_*`` is the source, ``output_*`` the destination).
    copies: list[AuditRow] = field(default_factory=list)
    model_name: str = ""
    input_shapes: tuple[tuple[int, ...], ...] = ()
    autocast_dtype: torch.dtype | None = None
    #: ATen op calls seen in the step, for scale.
    ops_seen: int = 0
    #: ``layout_summary`` of the model's parameters when audited.
    parameter_layouts: dict[str, int] = field(default_factory=dict)

    def format_table(self) -> str:
        """A human-readable report; says "no op lost the channels_last layout" when ``rows`` is empty."""
        dtype = str(self.autocast_dtype).replace("torch.", "") if self.autocast_dtype is not None else "off"
        shapes = ", ".join(_fmt_shape(s) for s in self.input_shapes)
        lines = [
            f"Layout audit of {self.model_name}: one forward + backward, input {shapes}, autocast {dtype}, "
            f"{self.ops_seen} op calls; parameters {self.parameter_layouts}",
        ]
        if not self.rows:
            lines.append("No op lost the channels_last layout.")
        else:
            calls = sum(r.count for r in self.rows)
            lines.append(f"{len(self.rows)} ops ({calls} calls per step) lost the channels_last layout:")
            lines.append(_table(self.rows))
        explicit = sum(r.count for r in self.copies if r.kind == "copy")
        lines.append(
            f"Layout-changing copies per step: {self.layout_copies} "
            f"({explicit} explicit, {self.layout_copies - explicit} implicit in convolutions with mixed layouts)"
            + (":" if self.copies else ".")
        )
        if self.copies:
            lines.append(_table(self.copies))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_table()


def _fmt_shape(shape: Sequence[int]) -> str:
    return "(" + ",".join(str(s) for s in shape) + ")"


def _table(rows: list[AuditRow]) -> str:
    header = ("count", "phase", "module path", "op", "kind", "input shape / strides", "output shape / strides")
    body = [
        (
            str(r.count), r.phase, r.module_path, r.op, r.kind,
            " ".join(f"{_fmt_shape(s)}/{_fmt_shape(st)}" for s, st in zip(r.input_shapes, r.input_strides)),
            f"{_fmt_shape(r.output_shape)}/{_fmt_shape(r.output_stride)}",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    fmt = lambda row: "  ".join(c.rjust(w) if i == 0 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
    return "\n".join([fmt(header), fmt(tuple("-" * w for w in widths)), *(fmt(row) for row in body)])


def _definite(t: Any) -> str | None:
    """``"cl"`` / ``"nchw"`` for a rank-4/5 strided tensor that is one layout and not also the
    other, else ``None``. Both is torch's own test (size-1 dims ignored: a ``(N, C, 1, 1)`` map is
    the same memory in both, and a kernel's ``.contiguous(memory_format=...)`` of it copies nothing)."""
    if not isinstance(t, torch.Tensor) or t.dim() not in (4, 5) or t.layout is not torch.strided or t.numel() == 0:
        return None
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    cl, nchw = is_channels_last(t) or t.is_contiguous(memory_format=fmt), t.is_contiguous()
    if cl and not nchw:
        return "cl"
    if nchw and not cl:
        return "nchw"
    return None


def _relabels_whole_tensor(out: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    # A view that is dense and as big as its input (permute, transpose, view to NHWC for a
    # LayerNorm) renames dims without touching memory: nothing is lost until a later op copies.
    if out.numel() != max(t.numel() for t in inputs):
        return False
    dims = sorted((out.stride(d), out.shape[d]) for d in range(out.dim()) if out.shape[d] > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _keeps_channels_last_order(t: torch.Tensor) -> bool:
    # Memory order of the non-size-1 dims: channels innermost, then W, H(, D), batch outermost.
    order = (1, 3, 2, 0) if t.dim() == 4 else (1, 4, 3, 2, 0)
    strides = [t.stride(d) for d in order if t.shape[d] > 1]
    return t.numel() == 0 or all(a <= b for a, b in zip(strides, strides[1:]))


class _Recorder(TorchDispatchMode):
    """Sees every ATen op of the step; groups the ones that lose the layout, and the layout copies."""

    def __init__(self, where: Callable[[], tuple[str, str]]) -> None:
        super().__init__()
        self.where = where
        self.lost: dict[tuple, AuditRow] = {}
        self.copies: dict[tuple, AuditRow] = {}
        self.ops_seen = 0

    @staticmethod
    def _add(table: dict[tuple, AuditRow], row: AuditRow) -> None:
        key = (row.op, row.module_path, row.phase, row.input_shapes, row.input_strides, row.output_shape, row.output_stride)
        if key in table:
            table[key].count += 1
        else:
            table[key] = row

    def _row(self, op: str, kind: str, ins: list[torch.Tensor], out: torch.Tensor) -> AuditRow:
        phase, path = self.where()
        return AuditRow(
            op=op, module_path=path, phase=phase,
            input_shapes=tuple(tuple(t.shape) for t in ins), input_strides=tuple(t.stride() for t in ins),
            output_shape=tuple(out.shape), output_stride=out.stride(), kind=kind,
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.ops_seen += 1
        op = str(func.overloadpacket)
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        flat_out = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if op in _COPY_OPS:
            src, dst = (args[1], args[0]) if op == "aten.copy_" else (args[0], flat_out[0] if flat_out else None)
            a, b = _definite(src), _definite(dst)
            if a and b and a != b:
                self._add(self.copies, self._row(op, "copy", [src], dst))
        elif op in _CONV_OPS:
            # convolution(input, weight, ...); convolution_backward(grad_output, input, weight, ...):
            # the kernel converts whichever operands disagree with the layout it picks.
            operands = list(args[:2] if op == "aten.convolution" else args[:3])
            if len({_definite(t) for t in operands} - {None}) > 1:
                self._add(self.copies, self._row(op, "implicit", operands, flat_out[0]))
        cl_inputs = [t for t in flat_in if _definite(t) == "cl"]
        if cl_inputs:
            kind = "view" if func.is_view else "copy" if op in _COPY_OPS else "compute"
            for out in flat_out:
                if out.dim() not in (4, 5) or out.layout is not torch.strided or _keeps_channels_last_order(out):
                    continue
                if kind != "view" or not _relabels_whole_tensor(out, cl_inputs):
                    self._add(self.lost, self._row(op, kind, cl_inputs, out))
        return result


class _GradFnRecorder(UserFrameMode):
    """Notes which module path created each autograd node, to attribute backward ops."""

    def __init__(self, current_path: Callable[[], str]) -> None:
        super().__init__()
        self.current_path = current_path
        self.node_path: dict[Any, str] = {}

    def note(self, output: Any, path: str) -> None:
        for t in tree_flatten(output)[0]:
            node = t.grad_fn if isinstance(t, torch.Tensor) else None
            if node is not None and node not in self.node_path:
                self.node_path[node] = path

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.note(result, self.current_path())
        return result


def _hook_backward_paths(root: Any, node_path: dict[Any, str], set_path: Callable[[str], None]) -> list[Any]:
    """Pre-hook every node of the graph under ``root`` to announce its module path; nodes that
    no module call created directly (inside a composite op, AccumulateGrad) take their consumer's."""
    handles, paths, stack = [], {root: node_path.get(root, "(loss)")}, [root]
    while stack:
        node = stack.pop()
        path = paths[node]
        try:
            handles.append(node.register_prehook(lambda grad_outputs, path=path: set_path(path)))
        except (RuntimeError, AttributeError):  # a node kind without pre-hooks: keep the previous path
            pass
        for child, _ in node.next_functions:
            if child is not None and child not in paths:
                paths[child] = node_path.get(child, path)
                stack.append(child)
    return handles


def _as_tuple(example_input: torch.Tensor | tuple) -> tuple:
    return example_input if isinstance(example_input, tuple) else (example_input,)


def audit_model(
    model: nn.Module,
    example_input: torch.Tensor | tuple,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
    convert_input: bool = True,
) -> AuditReport:
    """Run one forward + backward of ``model`` and report the ops that lose channels_last.

    Args:
        model: the model, normally already converted with ``cltrain.to_channels_last``
            (the audit does not convert it). Its train/eval mode is used as is.
        example_input: a batch tensor, or a tuple of positional arguments for ``model``.
        loss_fn: maps the model output to a scalar; default ``cltrain.timing.steps.scalar_loss``.
        autocast_dtype: run the step under ``torch.autocast`` in this dtype (as training would).
        convert_input: put rank-4/5 input tensors in channels_last first (default), so the
            report is about the model and not about the data path.

    Returns:
        An ``AuditReport``; ``print(report)`` shows the table.

    Raises:
        ValueError: the output gives no scalar to differentiate (see ``scalar_loss``).
    """
    inputs = tuple(to_channels_last(x) if convert_input and isinstance(x, torch.Tensor) else x for x in _as_tuple(example_input))
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    names = {id(m): name for name, m in model.named_modules()}
    root_name = f"({type(model).__name__})"
    module_stack: list[str] = []
    state = {"phase": "forward", "backward_path": root_name}

    def current_path() -> str:
        return module_stack[-1] if module_stack else root_name

    def where() -> tuple[str, str]:
        return (state["phase"], current_path() if state["phase"] == "forward" else state["backward_path"])

    def pre(module: nn.Module, args: Any) -> None:
        module_stack.append(names.get(id(module)) or root_name)

    def post(module: nn.Module, args: Any, output: Any) -> None:
        # Nodes the function mode cannot see (custom autograd.Function.apply) belong to this module.
        grad_fns.note(output, current_path())
        if module_stack:
            module_stack.pop()

    saved_grads = {p: p.grad for p in model.parameters()}
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers() if b is not None]
    recorder = _Recorder(where)
    grad_fns = _GradFnRecorder(current_path)
    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post, always_call=True))]
    try:
        for p in saved_grads:
            p.grad = None
        with recorder:
            with grad_fns, autocast_for(device, autocast_dtype):
                output = model(*inputs)
                loss = (loss_fn or scalar_loss)(output)
            state["phase"] = "backward"
            if loss.grad_fn is not None:
                handles += _hook_backward_paths(loss.grad_fn, grad_fns.node_path, lambda p: state.update(backward_path=p))
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p, g in saved_grads.items():
            p.grad = g
        with torch.no_grad():
            for b, saved in saved_buffers:
                b.copy_(saved)
    copies = list(recorder.copies.values())
    return AuditReport(
        rows=list(recorder.lost.values()),
        layout_copies=sum(r.count for r in copies),
        copies=copies,
        model_name=type(model).__name__,
        input_shapes=tuple(tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor)),
        autocast_dtype=autocast_dtype,
        ops_seen=recorder.ops_seen,
        parameter_layouts=layout_summary(model),
    )


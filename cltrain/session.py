"""A model's channels_last layout for one run, whatever runs it: the core behind ``ChannelsLast`` (Lightning),
``cltrain.loops`` (Fabric, plain loops) and the Hugging Face hook.

Each front door lends the session a host (``cltrain.host``: say a line, which rank decides, a broadcast and a sum over
the ranks, the optimizers and the model's copies). ``LayoutSession`` decides and converts (the channels-last format of
each parameter's rank, contiguous weights under a sharding engine, channels-last 1-D where timed faster), applies the
kernel guardrails (the modules any rank finds hazardous), says what it did, runs the first-batch check on the
deciding rank with the step runner it is handed, shares the result with every rank, and applies the verdict with one
meaning each:

* ``"passed"`` / ``"not checked"``: nothing changes;
* ``"fallback"``: the named parts run in NCHW (``cltrain.check.fallback``), in the model and in its copies;
* ``"contiguous"``: the whole model in NCHW (its parameters, buffers and guardrails) and its inputs put in NCHW at
  its entry, in the model and in its copies.

Every change of a parameter's layout gives the optimizer state its parameter's strides. ``InputTrace`` follows the
first forward of each kind of batch: a converted input that reaches no convolution in channels_last is left as it
arrives from then on. Every line starts with ``ChannelsLast`` and is the same from every adapter.

Example (what a front door does; ``cltrain.loops`` is the shortest one)::

    session = LayoutSession(host=Host(optimizers=lambda: [optimizer]))
    session.convert(model, device=torch.device("cpu"), owner="convert_model(mode='full')")
    session.check("train", model, lambda: check_plain_step(model, batch, step))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from cltrain.check.fallback import Fallback, apply_fallbacks
from cltrain.check.localise import first_line
from cltrain.check.result import LayoutCheck
from cltrain.guardrails import GuardRecord, apply_guardrails
from cltrain.host import Host, Say
from cltrain.layout import (CONV1D_TYPES, CONV_TYPES, layout_summary, to_channels_last, to_channels_last_1d,
                            to_contiguous)
from cltrain.layout.conv_reach import ConvReach
from cltrain.layout.optimizer_state import restride_optimizer_state
from cltrain.layout.tensors import is_compiled, memory_format_for
from cltrain.nchw_code import relayout
from cltrain.sharding import not_checked_reason, sharded_line, sharding_of

if TYPE_CHECKING:
    from cltrain.timing.probe import ProbeResult

__all__ = ["InputTrace", "LayoutSession"]


@contextlib.contextmanager
def no_autotune() -> Iterator[None]:
    """``cudnn.benchmark`` off inside: the check's runs are once-only, at the check's batch size, in float32 and
    both layouts, so autotuning each of their convolutions only adds to the check's time; the run's own steps
    autotune as the user set."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before

class LayoutSession:
    """A model's layout for one run: see the module docstring.

    Args:
        mode: ``"full"`` restrides every 4-D/5-D parameter and buffer; ``"conv"`` only convolution weights.
        guard: apply ``cltrain.guardrails.apply_guardrails`` after every conversion.
        host: what the front door lends (``cltrain.host``; default: one process or ``torch.distributed``'s group).

    Attributes:
        layout: ``"channels_last"`` or ``"contiguous"``; ``None`` before ``convert``.
        one_d: Conv1d weights and rank-3 inputs get channels-last 1-D strides too (``mode="auto"`` timed it faster).
        sharding: the engine holding the parameters (``cltrain.sharding``), which then stay contiguous, or ``None``.
        guardrails: the ``GuardRecord`` of each known fault worked around (``None`` with ``guard=False``).
        probe: the ``cltrain.timing.probe.ProbeResult`` that ``choose`` kept (the same on every rank), or ``None``.
        fallbacks: the ``Fallback``s the checks chose, applied to the model and its copies (a ``"contiguous"``
            verdict is ``Fallback("module", "")``: the model runs in NCHW, its inputs put in NCHW at its entry).
        layout_checks: the ``LayoutCheck`` of each kind of batch checked (``"train"``, ``"eval"``).
        summary: ``cltrain.layout_summary`` of the model's parameters and buffers once converted.
        device: where the model trains; dtype: the dtype its convolutions compute in (``None``: float32).
    """

    def __init__(self, mode: str = "full", *, guard: bool = True, host: Host | None = None) -> None:
        self.mode = mode
        self.guard = guard
        self.host = host or Host()
        self.layout: str | None = None
        self.one_d = False
        self.sharding: str | None = None
        self.guardrails: list[GuardRecord] | None = None
        self.probe: ProbeResult | None = None
        self.fallbacks: list[Fallback] = []
        self.layout_checks: dict[str, LayoutCheck] = {}
        self.summary: dict[str, int] | None = None
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self._expected: dict[str, torch.memory_format | None] | None = None
        self._told: set[str] = set()

    def say(self, message: str, warn: bool = False) -> None:
        """One line, through the host."""
        self.host.say(message, warn)

    @classmethod
    def of(cls, model: nn.Module, *, dtype: torch.dtype | None = None, guard: bool = True, host: Host | None = None,
           sharding: str | None = None) -> LayoutSession:
        """A session for ``model`` as it is (converted already, by ``convert_model`` or by hand): its layout is
        channels_last, its engine ``sharding`` or the one that shards it already, if any."""
        session = cls(guard=guard, host=host)
        session.layout = "channels_last"
        session.device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
        session.dtype = dtype
        session.sharding = sharding if sharding is not None else sharding_of(model)
        session.summary = layout_summary(model, buffers=True)
        return session

    # ---- decide and convert ----------------------------------------------------------------------------------------

    def choose(self, model: nn.Module, shape: tuple[int, ...], *, steps: int, device: torch.device,
               autocast_dtype: torch.dtype | None, timeout: float, owner: str) -> str:
        """Time a few steps of ``model`` in both layouts on a synthetic batch of ``shape`` on the deciding rank, in a
        child process (``cltrain.timing.probe.probe_layout``: a native crash in either layout's kernels must not end
        the run), and keep the faster on every rank (DDP's buckets must agree); rank-3 ``(N, C, L)`` times
        channels-last 1-D (``one_d``). One line says what was timed and kept, under ``owner``
        (``"ChannelsLast(mode='auto')"``). Returns the layout kept (``"contiguous"`` where the timing failed)."""
        from cltrain.timing.probe import probe_layout

        self.one_d = len(shape) == 3
        found = None
        if self.host.deciding():
            found = probe_layout(model, shape, steps=steps, device=device, autocast_dtype=autocast_dtype,
                                 guardrails=self.guard, timeout=timeout)
        self.probe = self.host.broadcast(found)
        self.layout = self.probe.layout
        if self.probe.failure is not None:
            self.say(f"{owner}: {self.probe.failure}; keeping contiguous.", True)
        else:
            timed = ", ".join(f"{k} {v * 1e3:.1f} ms/step" for k, v in sorted(self.probe.timings.items()))
            self.say(f"{owner}, timed {self.probe.method}: {timed} -> keeping {self.layout}.", False)
        return self.layout

    def convert(self, model: nn.Module, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                sharding: str | None = None, layout: str | None = None, owner: str | None = None,
                inputs: bool = True) -> nn.Module:
        """Put ``model`` in the session's layout, in place, with the guardrails and the fallbacks chosen so far, and
        the host's copies of it; in a run of several ranks (every rank calls here) the guardrails cover the modules
        any rank finds hazardous (``hazards_over_ranks``).

        Args:
            device: where it trains (default: its parameters' device); the guardrails depend on the backend.
            dtype: the dtype its convolutions compute in (the autocast dtype, or ``None`` for float32).
            sharding: the engine that shards it or will (``cltrain.sharding.sharding_of``): parameters contiguous.
            layout: ``"channels_last"`` or ``"contiguous"`` (default: the session's, else channels_last).
            owner: the front door, as the line names it (``"ChannelsLast(mode='full')"``): the session says what it
                did (``report_conversion``); ``None``: nothing is said.
            inputs: the front door converts the model's inputs (said under a sharding engine).
        """
        if device is None:
            device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
        self.device, self.dtype = torch.device(device), dtype
        held = sharding_of(model)  # sharded already: the engine owns the parameters' layout
        self.sharding = sharding if sharding is not None else held
        self.layout = layout or self.layout or "channels_last"
        records = self._put_in_layout(model, united=True, held=held is not None)
        if self.guard:
            self.guardrails = records
        apply_fallbacks(model, self.fallbacks)  # a later fit: the conversion restrided their weights
        self.summary = layout_summary(model, buffers=True)
        self.convert_copies(self.host.copies())
        if owner is not None:
            self.report_conversion(owner, model, inputs)
        return model

    def _put_in_layout(self, model: nn.Module, united: bool = False, held: bool = False) -> list[GuardRecord]:
        """``model`` in the session's layout, guarded; ``united``: every rank calls here at the same point, and the
        guardrails cover the modules any rank finds hazardous."""
        if self.sharding is not None:
            if not held:  # FSDP2 refuses channels_last parameters; the others flatten them contiguous
                to_contiguous(model)
        elif self.layout == "channels_last":
            to_channels_last(model, mode="conv" if self.mode == "conv" else "full")
            if self.one_d:
                to_channels_last_1d(model)
        else:  # NCHW, even for a model that arrived channels_last
            to_contiguous(model)
        if not self.guard:
            return []
        # After every conversion: converting again would undo a guarded weight's layout.
        return apply_guardrails(model, device=self.device, dtype=self.dtype, layout=self.layout,
                                sum_over_ranks=self.host.sum if united and self.host.several() else None)

    def convert_copies(self, copies: Iterable[nn.Module]) -> None:
        """Put copies of the model (an EMA's ``AveragedModel``, SWA's) in its layout, with its fallbacks."""
        if self.layout is None or self.sharding is not None:
            return
        for copy_ in copies:
            self._put_in_layout(copy_)
            _apply_to_copy(copy_, self.fallbacks)

    def resume(self) -> None:
        """After a checkpoint's optimizer state is restored, which keeps the strides it was saved with: every state
        tensor of the host's optimizers takes its parameter's strides, and the model's copies made since the
        conversion (an EMA's, SWA's) join its layout. A sharding engine owns both."""
        if self.layout is None or self.sharding is not None:
            return
        self.convert_copies(self.host.copies())
        restride_optimizer_state(self.host.optimizers())

    def has_convolutions(self, model: nn.Module) -> bool:
        """Whether ``model`` has a layer channels_last speeds up."""
        convs = CONV_TYPES + CONV1D_TYPES if self.one_d else CONV_TYPES
        return any(isinstance(m, convs) for m in model.modules())

    def conversion_line(self, owner: str, model: nn.Module, inputs: bool = True) -> str:
        """The one line that says what ``convert`` did (``owner``: ``"ChannelsLast(mode='full')"``)."""
        if self.sharding is not None:
            return f"{owner}: {sharded_line(self.sharding, inputs)}"
        counts = ", ".join(f"{n} {k}" for k, n in (self.summary or {}).items())
        return f"{owner}: model layout is {self.layout}; parameters and buffers: {counts}."

    def report_conversion(self, owner: str, model: nn.Module, inputs: bool = True) -> None:
        """Say the conversion line, the guardrails applied, and (once) that a model without convolutions gains
        nothing."""
        if not self.has_convolutions(model) and "no convolutions" not in self._told:
            self._told.add("no convolutions")
            self.say(f"{owner.partition('(')[0]}: {type(model).__name__} has no Conv2d/Conv3d/ConvTranspose layer, so "
                     "channels_last has nothing to speed up; remove it or keep it for the layout checks.", True)
        self.say(self.conversion_line(owner, model, inputs), self.sharding is not None and not inputs)
        if self.guardrails:
            self.say("ChannelsLast: worked around known kernel faults: "
                     + "; ".join(r.line() for r in self.guardrails), False)

    # ---- the first-batch check -------------------------------------------------------------------------------------

    def check(self, kind: str, model: nn.Module, run: Callable[[], LayoutCheck], *, report: bool = True) -> LayoutCheck:
        """The first-batch check of ``kind`` (once per kind): ``run()`` (a step runner: ``cltrain.check.plain_step``,
        ``cltrain.check.lightning_step``) on the host's deciding rank, its result shared with every rank (each then
        applies the same, or DDP's parameter layouts disagree), applied to ``model``, the host's copies and its
        optimizers' state, and said in one line (``report``). A failure of the check itself is reported as not
        checked: it never ends the run."""
        result = None
        if self.sharding is not None:
            result = LayoutCheck("not checked", reason=not_checked_reason(self.sharding))
        elif self.host.several() and any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
            result = LayoutCheck("not checked", reason="SyncBatchNorm in a run of several ranks: its copies would wait "
                                 "for the other ranks (check the model once in a single process)")
        elif self.host.deciding():
            try:
                with no_autotune():
                    result = run()
            except Exception as error:  # noqa: BLE001 - the check failing must not end the run
                result = LayoutCheck("not checked", reason=f"the check itself failed ({first_line(error)})")
        result = self.host.broadcast(result)
        self.layout_checks[kind] = result
        self.apply(result, model)
        if report:
            self.say(f"ChannelsLast {result.line(kind)}", result.verdict in ("fallback", "contiguous"))
        return result

    def apply(self, result: LayoutCheck, model: nn.Module) -> None:
        """What ``result`` chose, on ``model`` and the host's copies (see the module docstring), and the host's
        optimizers' state in its parameters' strides."""
        if result.verdict == "fallback":
            chosen = list(result.fallbacks)
        elif result.verdict == "contiguous":  # the whole model, its inputs put in NCHW at its entry
            self.layout = "contiguous"
            records = self._put_in_layout(model, united=True)  # every rank applies the verdict here
            if self.guard:
                self.guardrails = records
            chosen = [Fallback("module", "")]
        else:
            return
        self.fallbacks += [f for f in chosen if f not in self.fallbacks]
        apply_fallbacks(model, self.fallbacks)
        self.summary = layout_summary(model, buffers=True)
        self.convert_copies(self.host.copies())
        restride_optimizer_state(self.host.optimizers())


    # ---- the layout for the whole run ------------------------------------------------------------------------------

    def expect(self, model: nn.Module) -> None:
        """Remember the layout of ``model``'s 4-D/5-D parameters and buffers as they are now (converted, guarded,
        the verdict applied), by name: what ``keep`` puts back."""
        self._expected = {_stands_for(name): _layout_of(t) for name, t in _named_tensors(model)}

    def keep(self, model: nn.Module, *, after: str = "", line: str | None = None,
             aliases: Iterable[torch.Tensor] = ()) -> list[str]:
        """Put back in their expected layout (``expect``) the parameters and buffers that something moved since,
        in place, and the host's optimizers' state in its parameters' strides; one line the first time, naming them
        and ``after`` (what ran), or ``line`` where given. A pruning's ``weight_orig`` and ``weight_mask`` and a
        parametrization's ``original`` are kept as the weight they stand for; a tensor of ``aliases`` that shares a
        moved tensor's data shares its new data (``cltrain.nchw_code.relayout``). Returns the names put back.

        It walks the parameters once a call: its callers call it where something may have moved them (an epoch's
        or a validation's end, a pruning), never every step.

        Example::

            >>> session = LayoutSession()
            >>> model = session.convert(torch.nn.Conv2d(3, 8, 3))
            >>> session.expect(model)
            >>> model.weight.data = model.weight.data.contiguous()   # a hook writes .data in NCHW
            >>> session.keep(model, after="a test"), model.weight.is_contiguous(memory_format=torch.channels_last)
            (['weight'], True)
        """
        expected = self._expected
        if expected is None or self.sharding is not None:
            return []
        moved, aliases = [], list(aliases)
        for name, t in _named_tensors(model):
            want = expected.get(_stands_for(name))
            if want is not None and not t.is_contiguous(memory_format=want):
                relayout(t, want, aliases)
                moved.append(name)
        restride_optimizer_state(self.host.optimizers())
        if moved and (line or "") not in self._told:
            self._told.add(line or "")
            shown = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
            self.say(line or f"ChannelsLast: {len(moved)} parameter(s) and buffer(s) left their layout"
                     f"{after and ' ' + after} ({shown}); put back in {self.layout} with their optimizer state.", False)
        return moved


def _apply_to_copy(copy_: nn.Module, fallbacks: list[Fallback]) -> None:
    """The fallbacks on a copy of the model, whose names may sit under ``module.`` (``AveragedModel``)."""
    names = {name for name, _ in copy_.named_modules()}
    wanted = [f for f in fallbacks if f.kind != "model"]
    for prefix in ("", "module."):
        if all(f"{prefix}{f.module}".rstrip(".") in names for f in wanted):
            apply_fallbacks(copy_, [Fallback(f.kind, f"{prefix}{f.module}".rstrip(".")) for f in wanted])
            return


class InputTrace:
    """Which converted inputs of the first forward of each kind of batch reach a convolution in channels_last.

    ``start(kind, converted, model)`` holds a ``cltrain.layout.conv_reach.ConvReach`` around that forward (not
    around a compiled one: a ``TorchFunctionMode`` would change what Dynamo compiles); ``end()`` leaves it and keeps
    the keys of the inputs no convolution took in channels_last in ``left_as_is[kind]``: converting them is a copy
    that helps nothing, and one line says so, once per input shape.
    """

    def __init__(self, say: Say) -> None:
        self.say = say
        self.left_as_is: dict[str, frozenset[Hashable]] = {}
        self._active: tuple[str, ConvReach, dict[Hashable, torch.Tensor]] | None = None
        self._told: set[str] = set()

    def traced(self, kind: str) -> bool:
        """Whether the first forward of ``kind`` was traced (or is being traced)."""
        return kind in self.left_as_is

    def start(self, kind: str, converted: dict[Hashable, torch.Tensor], model: nn.Module) -> bool:
        """Trace this forward of ``kind``; ``False`` where it is not traced (nothing converted, or compiled)."""
        self.left_as_is[kind] = frozenset()
        if not converted or is_compiled(model):
            return False
        self._active = (kind, ConvReach(converted), converted)
        self._active[1].__enter__()
        return True

    def end(self, completed: bool = True) -> list[Hashable] | None:
        """Leave the trace; the keys left as they arrive from now on (``None``: nothing was traced or judged)."""
        if self._active is None:
            return None
        kind, reach, converted = self._active
        self._active = None
        reach.__exit__(None, None, None)
        if not completed or reach.convolutions == 0:  # nothing seen to judge by: keep converting
            return None
        left = sorted(set(converted) - reach.reached, key=str)
        if left:
            self.left_as_is[kind] = frozenset(left)
            shapes = ", ".join(str(tuple(converted[k].shape)) for k in left)
            if shapes not in self._told:
                self._told.add(shapes)
                self.say(f"ChannelsLast: the input {shapes} reaches no convolution in channels_last (the model "
                         "reshapes or permutes it, or other code replaces it, first), so converting it is a copy that "
                         "helps nothing: it is left as it arrives from now on.", False)
        return left


_STANDS_FOR = ("_orig", "_mask")  # torch.nn.utils.prune's reparametrisation of a weight


def _stands_for(name: str) -> str:
    """The parameter a reparametrised tensor stands for: ``conv.weight_orig`` -> ``conv.weight``,
    ``conv.parametrizations.weight.original`` -> ``conv.weight``."""
    head, _, last = name.rpartition(".")
    for suffix in _STANDS_FOR:
        if last.endswith(suffix):
            return f"{head}.{last[:-len(suffix)]}" if head else last[:-len(suffix)]
    if last == "original" and ".parametrizations." in f".{head}":
        owner, _, weight = head.rpartition(".")
        owner = owner[:-len("parametrizations")].rstrip(".")
        return f"{owner}.{weight}" if owner else weight
    return name


def _layout_of(t: torch.Tensor) -> torch.memory_format | None:
    """The format ``t`` is in where it tells (``None`` where channels_last and NCHW strides coincide)."""
    fmt = memory_format_for(t)
    if fmt is None or (t.is_contiguous() and t.is_contiguous(memory_format=fmt)):
        return None
    return fmt if t.is_contiguous(memory_format=fmt) else torch.contiguous_format if t.is_contiguous() else None


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.dim() in (4, 5) and t.is_floating_point():
            yield name, t

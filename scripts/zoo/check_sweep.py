"""``python -m scripts.zoo.sweep --check-only``: the first-batch layout check's false alarms over the zoo.

In each model's process (``check_child``): a real ``Trainer`` with ``ChannelsLast()`` and one optimizer of
``scripts/zoo/training.py``, the check's verdict (``record_check``), and where it fell back or kept the model
contiguous (and for the passes ``--confirm-passes`` names) the confirmation of ``scripts/zoo/confirm.py``. In the
sweep's process (``check_sweep``): every model once per optimizer, and the outputs of ``scripts/zoo/check_report.py``.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable
from typing import Any

import torch

from scripts.zoo.check_report import summary, write_check_outputs
from scripts.zoo.confirm import FALLBACK_VERDICTS, JUDGED, confirm, died, judge
from scripts.zoo.models import Spec
from scripts.zoo.report import now
from scripts.zoo.training import OPTIMIZER_NAMES, fit


def record_check(result: dict[str, Any], callback: Any) -> None:
    """The first-batch layout check's verdict, line, the layout kept, and the largest agreeing difference."""
    check = callback.layout_checks.get("train")
    if check is not None:
        result["layout_check"] = check.verdict
        result["layout_check_line"] = check.line()
        result["layout_check_worst"] = check.worst
        result["layout_check_seconds"] = round(check.seconds, 2)
    result["layout_kept"] = callback.layout


def check_child(spec: Spec, net0: torch.nn.Module, batches: list[Any], args: argparse.Namespace,
                result: dict[str, Any], phase: Callable[[str], None]) -> None:
    """``--check-only``: ``ChannelsLast()``'s check with ``args.optimizer`` on ``batches[:2]``, and where it fell back
    (or the spec is in ``--confirm-passes``) the three runs of ``scripts/zoo/confirm.py`` on ``batches``."""
    from cltrain import ChannelsLast

    phase("channels_last")
    callback = ChannelsLast()
    module = fit(copy.deepcopy(net0), spec, batches[:2], callback, max_steps=2, precision=args.check_precision,
                 optimizer=args.optimizer)
    result.update(optimizer=args.optimizer, check_precision=args.check_precision, batch=args.batch,
                  losses_channels_last=[float(v) for v in module.losses])
    record_check(result, callback)
    if result.get("layout_check") in FALLBACK_VERDICTS or _confirms_passes(spec, args.confirm_passes):
        runs = result["confirm"] = {}
        confirm(spec, net0, batches, args.optimizer, args.confirm_steps, phase, runs, precision=args.check_precision)
        runs["verdict"] = judge(result["layout_check"], runs)


def _confirms_passes(spec: Spec, scope: str) -> bool:
    """Whether ``--confirm-passes`` (``all`` or comma-separated key prefixes) takes in ``spec``'s passing runs."""
    return scope == "all" or any(spec.key.startswith(p) for p in scope.split(",") if p)


def settle_confirmation(result: dict[str, Any], phase: str, crashed: bool) -> None:
    """A row whose process died in a confirmation run (``phase``): a native crash (``crashed``) in the channels_last
    run is that run's result and the row is ``ok``; anything else leaves the confirmation unjudged."""
    if "confirm" in result and "verdict" not in result["confirm"]:
        result["confirm"]["verdict"] = died(result, phase, result["status"] if crashed else None)
        result["status"] = "ok" if result["confirm"]["verdict"] in JUDGED else result["status"]


def check_sweep(ordered: list[Spec], specs: list[Spec], rows: list[dict[str, Any]], args: argparse.Namespace,
                m: dict[str, Any], command: str, run_one: Callable[..., dict[str, Any]]) -> int:
    """Every model of ``ordered`` once per optimizer, each by ``run_one(spec, args, log_dir, optimizer)`` (its own
    process), beside the ``rows`` already done (``--resume``); a model over ``--max-params`` is built once and its
    row stands for every optimizer. The outputs are written after every run, in the order of ``specs``."""
    optimizers = args.optimizers.split(",")
    done = {(r["key"], r.get("optimizer")) for r in rows}
    order = {s.key: i for i, s in enumerate(specs)}
    total = len(specs) * len(optimizers)
    for spec in ordered:
        for optimizer in optimizers:
            if (spec.key, optimizer) in done:
                continue
            result = run_one(spec, args, args.log_dir, optimizer)
            rows.append(result)
            done.add((spec.key, optimizer))
            if result["status"] == "skipped":
                for other in (o for o in optimizers if (spec.key, o) not in done):
                    rows.append(dict(result, optimizer=other))
                    done.add((spec.key, other))
            confirmed = (result.get("confirm") or {}).get("verdict")
            print(f"[{len(done)}/{total}] {spec.key} {OPTIMIZER_NAMES[optimizer]}: {result['status']} "
                  f"{result.get('layout_check', '')}{f' ({confirmed})' if confirmed else ''} {result['seconds']}s",
                  flush=True)
            m["load_end"], m["ended"] = " ".join(f"{x:.1f}" for x in os.getloadavg()), now()
            rows.sort(key=lambda r: (order.get(r["key"], len(order)), optimizers.index(r.get("optimizer", "sgd"))
                                     if r.get("optimizer", "sgd") in optimizers else len(optimizers)))
            write_check_outputs(args.out, rows, m, command, args, optimizers)
    print("\n".join(summary(rows, optimizers)))
    print(f"wrote {args.out.with_suffix('.md')}, .json")
    return 0

"""Map where oneDNN #6035 shows: each case of scripts/repro/onednn_1x1_strided_conv.py in its own process.

A case is one convolution's backward (input channels, output channels, kernel, stride, padding, groups,
size, batch, dtype, threads, input and weight layout) under one ISA: native, or AVX2 emulated with
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``. A process that dies is a crash, one that outlives
``--timeout`` a hang, one whose gradients differ from the float64 reference (oneDNN disabled) wrong.
Prints a markdown table per sweep (the ones in docs/troubleshooting.md) and the machine::

    python -m scripts.repro.onednn_1x1_boundary                       # every sweep, ~15 min on 2 cores
    python -m scripts.repro.onednn_1x1_boundary --sweeps channels --runs 3
    python -m scripts.repro.onednn_1x1_boundary --sweeps versions --python /tmp/venv213/bin/python
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

from cltrain.timing.clock import Stopwatch
from cltrain.timing.report import table, table_row
from scripts.harness import options, run_child, signal_name
from scripts.repro.onednn_1x1_strided_conv import CASE

REPRO = Path(__file__).resolve().parent / "onednn_1x1_strided_conv.py"
BASE = {**CASE, "cout": 32, "size": 96, "threads": 2}
ISAS = {"AVX512": {}, "AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}
FEW = (3, 8, 15)  # below the block on both ISAs; 8 == the AVX2 block; 15 == the AVX-512 block - 1


def _cases(**axes) -> list[dict]:
    """Every combination of ``axes`` (name -> values) over ``BASE``."""
    cases = [dict(BASE)]
    for name, values in axes.items():
        cases = [{**case, name: v} for case in cases for v in values]
    return cases


SWEEPS: dict[str, list[dict]] = {
    "channels": _cases(cin=range(1, 41)),
    "threads": _cases(cin=(1, 3, 4, 7, 8, 12, 15, 16, 17), threads=(1,)),
    "dtype": _cases(cin=(3, 4, 7, 8, 12, 15, 16, 24), dtype=("bf16",)),
    "stride": _cases(cin=FEW, stride=(1, 3)),
    "padding": _cases(cin=FEW, padding=(1,)),
    "kernel": _cases(cin=FEW, kernel=(3,), padding=(1,)),
    "groups": _cases(cin=(4, 8, 16, 30), groups=(2,)) + _cases(cin=(3, 8, 16), groups=(-1,)),
    "size": _cases(cin=FEW, size=(8, 16, 32, 48, 64, 128, 224)),
    "batch": _cases(cin=FEW, batch=(1, 2, 32)),
    "cout": _cases(cin=FEW, cout=(1, 4, 8, 16, 64, 256)),
    "layouts": _cases(cin=FEW, input_layout=("channels_last", "contiguous"), weight_layout=("channels_last", "contiguous")),
    "conv3d": _cases(op=("conv3d",), cin=FEW, size=(24,)),
    "conv_transpose2d": _cases(op=("conv_transpose2d",), cin=(32,), cout=FEW, size=(48,)),
    "versions": _cases(cin=(1, 3, 7, 8, 15, 16)),
    # the workaround's path: a stride-1 1x1 conv of the strided slice
    "stride1": _cases(cin=(1, 2, 3, 4, 5, 7, 8, 12, 15), stride=(1,), size=(8, 48, 128, 224)),
}
for case in SWEEPS["groups"]:
    if case["groups"] == -1:  # depthwise
        case.update(groups=case["cin"], cout=case["cin"])


def run_case(case: dict, isa: str, python: str, timeout: float, repeats: int) -> str:
    """One process: ``ok``, ``WRONG (w 3.4e+00)``, ``NON-FINITE``, ``CRASH (SIGSEGV)``, ``HANG`` or ``error``."""
    cmd = [python, str(REPRO), "--json", "--repeats", str(repeats)]
    for key, value in case.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    child = run_child(cmd, timeout=timeout, env={**os.environ, **ISAS[isa], "PYTHONWARNINGS": "ignore"})
    if child.code is None:
        return "HANG"
    if child.code < 0:
        return f"CRASH ({signal_name(child.code)})"
    lines = [line for line in child.output.splitlines() if line.startswith("{")]
    if not lines:
        crashed = "free()" in child.output or "corrupted" in child.output
        return "CRASH (abort)" if crashed else f"error: {child.last_error()[:80]}"
    result = json.loads(lines[-1])
    if not result["wrong"]:
        return "ok"
    worst = max(result["weight_error"], result["input_error"])
    if worst == float("inf"):
        return "NON-FINITE"
    which = "w" if result["weight_error"] >= result["input_error"] else "x"
    return f"WRONG ({which} {worst:.1e})"


def describe(case: dict) -> str:
    """The case in one benchdnn-like string: the fields that differ from the repro's usual spelling."""
    op = {"conv2d": "", "conv3d": "3d ", "conv_transpose2d": "deconv "}[case["op"]]
    lay = lambda s: "cl" if s == "channels_last" else "nchw"  # noqa: E731
    return (f"{op}ic{case['cin']} oc{case['cout']} k{case['kernel']} s{case['stride']} p{case['padding']} "
            f"g{case['groups']} {case['size']}px mb{case['batch']} {case['dtype']} t{case['threads']} "
            f"x:{lay(case['input_layout'])} w:{lay(case['weight_layout'])}")


def main(argv: list[str] | None = None) -> None:
    parser = options(__doc__, python=(sys.executable, "the interpreter (another torch) that runs each case"),
                     runs=(1, "processes per case (the outcome can vary per run)"),
                     repeats=(3, "backward calls per process"), timeout=60.0)
    parser.add_argument("--sweeps", nargs="*", default=[s for s in SWEEPS if s != "versions"], choices=tuple(SWEEPS))
    parser.add_argument("--isas", nargs="*", default=list(ISAS), choices=tuple(ISAS))
    args = parser.parse_args(argv)
    machine = run_child([args.python, str(REPRO), "--repeats", "0"], env={**os.environ, "PYTHONWARNINGS": "ignore"})
    print(next(line for line in machine.output.splitlines() if line.startswith("Machine:")), flush=True)
    watch = Stopwatch().start()
    for sweep in args.sweeps:
        print(f"\n### {sweep}\n\n{table(['case', *args.isas], [])}", flush=True)
        for case in SWEEPS[sweep]:
            cells = []
            for isa in args.isas:
                outcomes = Counter(run_case(case, isa, args.python, args.timeout, args.repeats) for _ in range(args.runs))
                cells.append(", ".join(k if n == args.runs else f"{k} {n}/{args.runs}" for k, n in outcomes.items()))
            print(table_row([describe(case), *cells]), flush=True)
    print(f"\n{watch.elapsed():.0f} s", flush=True)


if __name__ == "__main__":
    main()

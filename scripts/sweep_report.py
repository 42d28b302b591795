"""Summarise a sweep: a markdown table and a PNG chart of images/second and top-1 per config.

    python train.py -m channels_last=true,false amp=true,false        # -> multirun/<date>/<time>/{0,1,2,3}
    python scripts/sweep_report.py multirun/<date>/<time>              # -> report.md, report.png there

Every run directory under the sweep directory holds a metrics.json (written by
train(cfg)); the speed-up column compares each run with the contiguous fp32 run
of the same model, image size, global batch and device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cltrain.app.report import collect, markdown_table, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory (Hydra's hydra.sweep.dir)")
    parser.add_argument("--out", type=Path, default=None, help="where to write report.md/report.png (default: sweep_dir)")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        parser.error(f"sweep_dir {args.sweep_dir}: no such directory")
    try:
        md, png = write_report(args.sweep_dir, args.out)
    except FileNotFoundError as err:
        print(f"sweep_report: error: {err}", file=sys.stderr)
        return 2
    print(markdown_table(collect(args.sweep_dir)))
    print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

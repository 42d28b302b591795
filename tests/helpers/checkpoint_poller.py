"""Poll a checkpoint file as fast as possible until a stop file appears; print what was seen as JSON.

    python -m tests.helpers.checkpoint_poller RUN/checkpoints/last.ckpt STOP_FILE

Each poll opens the file and classifies it: ``missing``, ``empty`` (0 bytes), ``partial`` (it does
not end with a zip end-of-central-directory record, as every complete ``torch.save`` file does) or
``complete``; ``min_size`` is the smallest non-empty size seen. Only the standard library, so it
starts polling at once.
"""

from __future__ import annotations

import json
import os
import sys

_END = b"PK\x05\x06"  # zip end-of-central-directory record: the last 22 bytes of a complete checkpoint


def poll(path: str, stop: str) -> dict[str, int]:
    counts = dict.fromkeys(("polls", "missing", "empty", "partial", "complete"), 0)
    smallest = None
    print("polling", flush=True)
    while not os.path.exists(stop):
        counts["polls"] += 1
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size:
                    f.seek(max(0, size - 22))
                    tail = f.read(22)
        except FileNotFoundError:
            counts["missing"] += 1
            continue
        if not size:
            counts["empty"] += 1
            continue
        smallest = size if smallest is None else min(smallest, size)
        counts["complete" if len(tail) == 22 and tail.startswith(_END) else "partial"] += 1
    counts["min_size"] = smallest or 0
    return counts


if __name__ == "__main__":
    print(json.dumps(poll(sys.argv[1], sys.argv[2])), flush=True)

"""Run by tests/core/test_host.py under torchrun: ``cltrain.host.Host`` in a real process group of two ranks (gloo).
Each rank writes OUT_DIR/rank<N>.json with what the host gave it.

    python -m tests.helpers.torchrun --standalone --nproc_per_node 2 -m tests.helpers.host_ranks OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cltrain.host import Host

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    said, logged = [], []
    host = Host(lambda line, warn: said.append(line), log=logged.append)
    host.say(f"rank {rank} says")
    host.log({"rank": float(rank)})
    result = {"several": host.several(), "deciding": host.deciding(), "broadcast": host.broadcast(f"rank {rank}'s"),
              "sum": host.sum(torch.tensor([rank + 1.0])).tolist(), "said": said, "logged": logged}
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()

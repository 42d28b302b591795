"""``cltrain.host.Host``: what a front door lends the session, in one process and in a real group of two ranks."""

from __future__ import annotations

import json
import logging
import sys

import torch
from torch import nn

from cltrain.host import Host
from tests.helpers import REPO, warm


def test_one_process_decides_says_through_the_logger_and_reads_what_it_lends_when_asked(caplog) -> None:
    optimizers, copies, aliases, logged = [], [], [], []
    host = Host(optimizers=lambda: optimizers, copies=lambda: copies, aliases=lambda: aliases, log=logged.append)
    assert not host.several() and host.deciding() and host.broadcast("mine") == "mine"
    flags = torch.ones(3)
    assert host.sum(flags) is flags
    with caplog.at_level(logging.INFO, logger="cltrain"):
        host.say("a line")
        host.say("a warning", True)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("INFO", "a line"), ("WARNING", "a warning")]
    host.log({"x": 1.0})
    assert logged == [{"x": 1.0}]
    model = nn.Conv2d(3, 4, 3)  # lent late: the host reads them when the session asks
    optimizers.append(torch.optim.SGD(model.parameters(), lr=0.1))
    copies.append(model)
    aliases.append(model.weight)
    assert host.optimizers() == optimizers and host.copies() == [model] and host.aliases()[0] is model.weight


def test_two_ranks_rank_0_decides_says_and_logs_and_every_rank_gets_its_value_and_the_sum(tmp_path) -> None:
    proc = warm.run([sys.executable, "-m", "tests.helpers.torchrun", "--standalone", "--nproc_per_node", "2",
                     "-m", "tests.helpers.host_ranks", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                    timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["several"] for r in ranks] == [True, True] and [r["deciding"] for r in ranks] == [True, False]
    assert [r["broadcast"] for r in ranks] == ["rank 0's", "rank 0's"]
    assert [r["sum"] for r in ranks] == [[3.0], [3.0]]
    assert [r["said"] for r in ranks] == [["rank 0 says"], []] and [r["logged"] for r in ranks] == [[{"rank": 0.0}], []]

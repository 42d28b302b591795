"""Every step's gradient under DDP is the ranks' average, through a change of layout after DDP wrapped the model:
the race's switch, a check's verdict (tests/helpers/ddp_grads.py: two gloo processes, an NCHW reference on both
ranks' batches each step). DDP keeps the strides its gradient buckets were built with; without building them again
(``--no-rebuild``, the negative control) the gradient after the switch is the average permuted."""

import json
import os
import sys
from pathlib import Path

import pytest
from tests.helpers import warm

REPO = Path(__file__).resolve().parents[2]


def _launch(out: Path, scenarios: str, *flags: str) -> list[dict]:
    proc = warm.run([sys.executable, "-m", "tests.helpers.ddp_grads", scenarios, str(out), *flags],
                    capture_output=True, text=True, timeout=300, cwd=REPO,
                    env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in ((0,) if scenarios == "alone" else (0, 1))]


@pytest.fixture(scope="module")
def together(tmp_path_factory) -> list[dict]:
    """The scenarios without a patched module, one after another in one launch."""
    return _launch(tmp_path_factory.mktemp("ddp_grads"), "race,unused,late,sizes,verdict")


def _runs(ranks: list[dict], run: str) -> list[dict]:
    return [{**rank["runs"][run], "lines": rank["lines"]} for rank in ranks]


def _errors(rank: dict, nchw: bool) -> list[float]:
    return [s["error"] for s in rank["steps"] if s["nchw"] == nchw]


@pytest.mark.parametrize("scenario, flags", [("race", ()), ("race", ("--no-rebuild",)), ("unused", ()), ("late", ()),
                                            ("sizes", ())],
                         ids=["rebuilt", "negative-control", "find-unused-parameters", "door-after-ddp", "rank-sizes"])
def test_the_race_switches_every_rank_to_nchw_with_the_ranks_average_gradient(together, tmp_path, scenario,
                                                                             flags) -> None:
    # find_unused_parameters=True: DDP never builds its buckets again by itself, and gets a new reducer; "late": the
    # door is given that DDP, made before it converted the model (the first channels_last steps were permuted);
    # "sizes": the ranks' image sizes differ at every step (one race for all sizes: per size, rank 1 switched alone
    # and waited in the buckets' rebuild for ever)
    ranks = _runs(_launch(tmp_path, scenario, *flags) if flags else together, scenario)
    for rank in ranks:
        assert rank["decision"] == "contiguous" and rank["steps"][-1]["nchw"], rank
        assert max(_errors(rank, nchw=False)) < 1e-5  # channels_last steps: DDP built its buckets in it
        if flags:  # buckets left with channels_last strides: the NCHW steps' gradients permuted
            assert min(_errors(rank, nchw=True)) > 0.3, rank["steps"]
        else:
            assert max(_errors(rank, nchw=True)) < 1e-5, rank["steps"]
    assert ranks[0]["steps"] == ranks[1]["steps"]


def test_a_verdict_that_moves_the_weights_after_ddp_wrapped_gives_the_right_first_step(together) -> None:
    # the model's own forward reads raw memory: the first batch's check keeps the whole model in NCHW, and the first
    # step already has the ranks' average (without the rebuild: wrong until DDP's own rebuild after step 1)
    for rank in _runs(together, "verdict"):
        assert rank["verdict"] == "contiguous" and all(s["nchw"] for s in rank["steps"])
        assert max(_errors(rank, nchw=True)) < 1e-5, rank["steps"]


def test_a_ddp_whose_buckets_cannot_be_built_again_keeps_the_layout_and_says_why(tmp_path) -> None:
    # a torch whose DDP lacks the private methods cltrain.ddp calls: not raced, channels_last kept, gradients right
    ranks = _runs(_launch(tmp_path, "unused", "--old-torch"), "unused")
    for rank in ranks:
        assert rank["decision"] is None and not any(s["nchw"] for s in rank["steps"])
        assert max(_errors(rank, nchw=False)) < 1e-5
    said = [line for line in ranks[0]["lines"] if "not raced" in line]
    assert len(said) == 1 and "cannot build its gradient buckets again" in said[0], said
    assert "layout='contiguous'" in said[0] and not any("not raced" in line for line in ranks[1]["lines"])


def test_a_door_that_switches_inside_ddps_forward_gives_the_ranks_average_gradient(tmp_path) -> None:
    # Accelerate's door converts in a forward hook, inside DDP's forward: the buckets are built again before that
    # step's backward (its DDP with find_unused_parameters=True gets a new reducer)
    # and with BatchNorm and an evaluation on rank 0 alone after each step (the race's judgement and DDP's buffer
    # broadcast once met in a different order on the two ranks: gloo's "Received data size doesn't match")
    ranks = _launch(tmp_path, "accelerate")
    for rank in [*_runs(ranks, "unused=True"), *_runs(ranks, "unused=False"), *_runs(ranks, "eval0")]:
        assert rank["decision"] == "contiguous" and rank["steps"][-1]["nchw"], rank
        assert max(s["error"] for s in rank["steps"]) < 1e-5, rank["steps"]


@pytest.mark.parametrize("flags", [(), ("--no-rebuild",)], ids=["rebuilt", "negative-control"])
def test_a_ddp_of_one_rank_gets_the_right_gradient_after_the_switch(tmp_path, flags) -> None:
    # torchrun --nproc_per_node=1, Fabric(strategy="ddp", devices=1): the buckets were built again only under
    # several ranks, so every NCHW step's gradient was permuted (relative error 1.0-1.8), in silence
    (rank,) = _runs(_launch(tmp_path, "alone", *flags), "alone")
    assert rank["decision"] == "contiguous" and rank["steps"][-1]["nchw"], rank
    assert max(_errors(rank, nchw=False)) < 1e-5
    if flags:
        assert min(_errors(rank, nchw=True)) > 0.3, rank["steps"]
    else:
        assert max(_errors(rank, nchw=True)) < 1e-5, rank["steps"]


def test_finding_the_wrappers_warns_nothing() -> None:
    # isinstance over every object read torch.distributed.reduce_op's __class__: a FutureWarning on each rank
    import warnings

    import torch.distributed  # noqa: F401 - its deprecated reduce_op among the objects walked
    from torch import nn

    from cltrain.ddp import wrappers

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert wrappers(nn.Conv2d(3, 4, 3)) == []

"""ChannelsLast under real DDP: two processes on CPU (gloo), launched by Lightning's ddp strategy."""

import json
import os
import sys
from pathlib import Path

import pytest
from tests.helpers import warm

REPO = Path(__file__).resolve().parents[2]
BUCKET_WARNING = "Grad strides do not match bucket view strides"
TOGETHER = ("callback", "user:raw_memory", "user:loss_view", "race")  # fits of one launch (torch warns of buckets once)


def run_ddp(tmp_path, *fits):
    proc = warm.run(
        [sys.executable, "-m", "tests.helpers.ddp_run", str(tmp_path), *fits], capture_output=True, text=True,
        timeout=600, cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # a module fixture: conftest's is later
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {fit: [json.loads((tmp_path / fit.replace(":", "-") / f"rank{r}.json").read_text()) for r in (0, 1)]
            for fit in fits}, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def together(tmp_path_factory):
    return run_ddp(tmp_path_factory.mktemp("ddp"), *TOGETHER)


def test_ddp_two_processes_channels_last_on_every_rank(together):
    ranks, output = together[0]["callback"], together[1]
    for r in ranks:
        assert r["world_size"] == 2 and r["steps"] == 3
        assert r["params_cl"] == [True] * 3, r
        assert r["grads_match"] == [True] * 3, r
        assert not [w for w in r["warnings"] if BUCKET_WARNING in w], r["warnings"]
    assert BUCKET_WARNING not in output


def test_ddp_check_catches_conversion_after_wrapping(tmp_path):
    # The negative control: converting after DDP built its buckets is what the callback avoids.
    ranks, output = run_ddp(tmp_path, "late")
    ranks = ranks["late"]
    # DDP's bucket views keep the strides the parameters had when it wrapped them, so the
    # reducer warns even though each grad matches its (restrided) parameter.
    assert any(BUCKET_WARNING in w for r in ranks for w in r["warnings"]), "late conversion went unnoticed\n" + output[-2000:]


def test_ddp_every_rank_applies_the_layout_checks_fallback(together):
    # Rank zero checks its first batch; every rank must apply the same fallback (or the same layout).
    # The loss's view gets the model's outputs in NCHW, not a contiguous model: DDP's buckets keep their layout.
    for pattern, verdicts in (("raw_memory", {"fallback"}), ("loss_view", {"fallback"})):
        ranks, output = together[0][f"user:{pattern}"], together[1]
        assert ranks[0]["steps"] == ranks[1]["steps"] == 3, output[-2000:]
        assert ranks[0]["checks"] == ranks[1]["checks"] and ranks[0]["checks"]["train"] in verdicts, ranks
        assert ranks[0]["fallbacks"] == ranks[1]["fallbacks"] and ranks[0]["layout"] == ranks[1]["layout"]
        assert all(len(r["losses"]) == 3 for r in ranks)
        assert BUCKET_WARNING not in output


def test_ddp_the_race_is_decided_on_rank_0_and_every_rank_switches_at_the_same_step(together):
    # A model slower in channels_last: rank 0 decides for NCHW and every rank switches at the same step; DDP builds its
    # gradient buckets again with the new strides (cltrain.ddp), so torch never warns that they differ (the gradients'
    # values: tests/core/test_ddp_grads.py)
    ranks, output = together[0]["race"], together[1]
    assert [r["steps"] for r in ranks] == [12, 12], output[-2000:]
    assert [r["layout"] for r in ranks] == ["contiguous", "contiguous"] and all(r["params_nchw_at_end"] for r in ranks)
    assert ranks[0]["params_cl"] == ranks[1]["params_cl"] and not ranks[0]["params_cl"][-1]  # every step alike
    assert all(r["grads_match"] == [True] * 12 for r in ranks), ranks
    assert ranks[0]["timings"] == ranks[1]["timings"] and ranks[0]["timings"]["channels_last"] > 0.15
    assert output.count("ChannelsLast: NCHW ") == 1, output[-3000:]  # said by rank 0 alone
    assert BUCKET_WARNING not in output

@pytest.mark.slow
def test_ddp_spawn_takes_the_callback_into_its_processes(tmp_path):
    # Lightning's ddp_spawn pickles the Trainer's callbacks: a closure in ChannelsLast() ended the run at its launch
    code = ("import sys, torch.multiprocessing as mp\n"
            "mp.set_sharing_strategy('file_system')  # torch's default needs more of /dev/shm than a container gives\n"
            "import lightning.pytorch as pl\n"
            "from cltrain import ChannelsLast\n"
            "from tests.helpers.plain_modules import Classifier, loader\n"
            "if __name__ == '__main__':\n"
            "    trainer = pl.Trainer(strategy='ddp_spawn', devices=2, accelerator='cpu', max_steps=2, logger=False,\n"
            "                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,\n"
            "                         callbacks=[ChannelsLast(layout='channels_last')])\n"
            "    trainer.fit(Classifier(), loader(16, 4))\n")
    script = tmp_path / "spawn.py"
    script.write_text(code)
    proc = warm.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=REPO,
                    env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)})
    out = proc.stdout + proc.stderr  # (the spawned processes trained: the launching Trainer counts no step)
    assert proc.returncode == 0 and "`max_steps=2` reached" in out and "layout check passed" in out, out[-3000:]

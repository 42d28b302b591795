"""The default race of the layouts (``layout="auto"``) and ``ChannelsLast(audit=True)`` on a real Trainer."""

import logging

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cltrain import ChannelsLast, is_channels_last, is_channels_last_1d, to_channels_last
from tests.helpers.plain_modules import Classifier, SlowIn, loader

pytestmark = pytest.mark.usefixtures("steady")  # the race times SlowIn's pauses alone


def fit(tmp_path, model, callback, steps=2, **kw):
    Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[callback], **kw,
    ).fit(model, loader(2 * steps, 2))


@pytest.mark.parametrize("slow, expected", [("channels_last", "contiguous"), ("contiguous", "channels_last")])
def test_the_race_keeps_the_faster_layout(tmp_path, caplog, slow, expected):
    model = Classifier(net=SlowIn(slow))
    callback = ChannelsLast()
    with caplog.at_level(logging.INFO):
        fit(tmp_path, model, callback, steps=12)
    assert callback.layout == expected and callback.decision.layout == expected
    assert callback.timings[slow] > callback.timings[expected] + 0.25
    line = [r.getMessage() for r in caplog.records if "faster here" in r.getMessage()]
    name = "NCHW" if expected == "contiguous" else "channels_last"
    assert len(line) == 1 and line[0].startswith(f"ChannelsLast: {name} ") and f"layout={expected!r}" in line[0]
    # the model and every batch after the decision are in the kept layout
    conv = model.net.body[0].weight
    assert is_channels_last(conv) == (expected == "channels_last")
    *_, last = model.seen["train"]
    stride, shape = tuple(last[:-1]), last[-1]
    assert (stride == torch.empty(shape, memory_format=torch.channels_last).stride()) == (expected == "channels_last")


def test_a_pinned_layout_is_not_raced(tmp_path, caplog):
    model = Classifier(net=SlowIn("none"))
    callback = ChannelsLast(layout="channels_last")
    with caplog.at_level(logging.INFO):
        fit(tmp_path, model, callback, steps=12)
    assert callback.layout == "channels_last" and callback.decision is None and "faster here" not in caplog.text
    assert all(tuple(s[:-1]) == torch.empty(s[-1], memory_format=torch.channels_last).stride()
               for s in model.seen["train"])
    pinned = Classifier(net=SlowIn("contiguous"))
    nchw = ChannelsLast(layout="contiguous")
    fit(tmp_path, pinned, nchw, steps=3)
    assert nchw.layout == "contiguous" and pinned.net.body[0].weight.is_contiguous() and not nchw.layout_checks


def test_a_bad_layout_or_the_old_auto_mode_is_named():
    with pytest.raises(ValueError, match=r"ChannelsLast\(layout='fast'\)"):
        ChannelsLast(layout="fast")
    with pytest.raises(ValueError, match=r"mode='auto'.*layout="):
        ChannelsLast(mode="auto")


class LosesLayout(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3)
        self.culprit = nn.Sequential(nn.Conv2d(8, 8, 1))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.stem(x).contiguous()  # planted: drops channels_last
        return self.head(self.culprit(h).mean((2, 3)))


def test_audit_on_first_batch_reports_the_planted_op(tmp_path, caplog):
    callback = ChannelsLast(audit=True)
    model = Classifier(net=LosesLayout())
    with caplog.at_level(logging.INFO):
        fit(tmp_path, model, callback)
    report = callback.audit_report
    assert report is not None and report.rows
    # the .contiguous() sits in LosesLayout.forward, i.e. module "net" of the LightningModule
    assert [(row.op, row.module_path, row.phase) for row in report.rows] == [("aten.clone", "net", "forward")]
    assert "layout audit" in caplog.text
    assert len(model.losses) == 2  # training went on, unaffected


def test_audit_clean_model_reports_nothing(tmp_path):
    callback = ChannelsLast(audit=True)
    fit(tmp_path, Classifier(), callback)
    assert callback.audit_report is not None and callback.audit_report.rows == []


def test_layout_attribute_says_what_the_model_is_in(tmp_path):
    full, off = ChannelsLast(), ChannelsLast(mode="off")
    assert full.layout is None and full.timings is None
    fit(tmp_path, Classifier(net=SlowIn("none")), full)
    assert full.layout == "channels_last" and full.timings is None and full.summary["channels_last"] == 1
    fit(tmp_path, Classifier(net=SlowIn("none")), off)
    assert off.layout is None


def test_a_race_keeping_nchw_makes_a_model_that_arrived_channels_last_contiguous(tmp_path):
    # the user converted the model already; the race finds NCHW faster, so "contiguous" must be true
    model = Classifier(net=to_channels_last(SlowIn("channels_last")))
    assert is_channels_last(model.net.body[0].weight)
    callback = ChannelsLast()
    fit(tmp_path, model, callback, steps=12)
    assert callback.layout == "contiguous" and set(callback.timings) == {"channels_last", "contiguous"}
    assert model.net.body[0].weight.is_contiguous() and not is_channels_last(model.net.body[0].weight)
    assert callback.summary == {"contiguous": 1, "rank1": 2, "rank2": 1}


class Audio1d(nn.Module):
    """An M5-style 1-D net."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(2, 8, 5, stride=2), nn.BatchNorm1d(8), nn.ReLU(), nn.Conv1d(8, 8, 3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.body(x).mean(2))


def audio_loader(n=4, batch_size=2):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 2, 64, generator=g), torch.randint(0, 4, (n,), generator=g)), batch_size)


def test_a_1d_model_and_its_batches_are_left_alone(tmp_path):
    model = Classifier(net=Audio1d())
    Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[ChannelsLast()],
    ).fit(model, audio_loader())
    assert model.net.body[0].weight.is_contiguous() and not is_channels_last_1d(model.net.body[0].weight)
    assert [tuple(s[:3]) for s in model.seen["train"]] == [(128, 64, 1)]

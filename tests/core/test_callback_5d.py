"""ChannelsLast on 5-D (video) models written without cltrain: channels_last_3d in fit, validate, test and
predict, with the race of the layouts and the audit."""

import pytest
import torch
import torchvision
from lightning.pytorch import Trainer

from cltrain import ChannelsLast, is_channels_last, layout_summary
from tests.helpers.plain_modules import Classifier, SlowIn, channels_last_strides, clip_loader, tiny_video_net


def trainer(tmp_path, callback, **kw):
    kw = {"max_steps": 2, "limit_val_batches": 1, "num_sanity_val_steps": 0, **kw}
    return Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[callback], **kw,
    )


def assert_channels_last_3d(records):
    assert records, "nothing was recorded"
    for *stride, shape in records:
        assert len(shape) == 5 and tuple(stride) == channels_last_strides(shape), (stride, shape)


def test_all_four_stages_see_channels_last_3d(tmp_path):
    model = Classifier(net=tiny_video_net())
    t = trainer(tmp_path, ChannelsLast())
    t.fit(model, clip_loader(4, 2), clip_loader(2, 2))
    t.validate(model, clip_loader(2, 2))
    t.test(model, clip_loader(3, 2))  # a ragged last batch of 1
    preds = t.predict(model, clip_loader(2, 2))
    for stage in ("train", "val", "test", "predict"):
        assert_channels_last_3d(model.seen[stage])
    assert layout_summary(model.net) == {"channels_last_3d": 2, "rank1": 5, "rank2": 1}
    assert preds[0].shape == (2, 4) and torch.isfinite(preds[0]).all()


def test_the_race_of_a_5d_model_keeps_its_choice_in_every_stage(tmp_path, steady):
    model = Classifier(net=SlowIn("channels_last", net=tiny_video_net()))
    callback = ChannelsLast()
    t = trainer(tmp_path, callback, max_steps=12, val_check_interval=12)
    t.fit(model, clip_loader(24, 2), clip_loader(2, 2))
    t.predict(model, clip_loader(2, 2))
    assert callback.layout == "contiguous" and callback.decision.layout == "contiguous"
    assert model.net.body[0].weight.is_contiguous() and not is_channels_last(model.net.body[0].weight)
    for stage in ("val", "predict"):  # after the decision: NCDHW
        for *stride, shape in model.seen[stage]:
            assert tuple(stride) == torch.empty(shape).stride()


@pytest.mark.slow
def test_r3d_18_trains_and_audits_clean_in_channels_last_3d(tmp_path):
    model = Classifier(net=torchvision.models.video.r3d_18(num_classes=4))
    callback = ChannelsLast(audit=True)
    t = trainer(tmp_path, callback, max_steps=1, limit_val_batches=0)
    t.fit(model, clip_loader(2, 2, frames=4, size=32))
    t.test(model, clip_loader(2, 2, frames=4, size=32))
    assert_channels_last_3d(model.seen["train"] + model.seen["test"])
    assert layout_summary(model.net)["channels_last_3d"] == 20
    report = callback.audit_report
    assert report.input_shapes == ((2, 3, 4, 32, 32),) and report.rows == [] and report.layout_copies == 0

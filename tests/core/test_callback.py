"""ChannelsLast on a real Trainer (CPU) with real torchvision / timm models."""

from collections import namedtuple

import logging
import warnings

import pytest
import torch
import torchvision
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from cltrain import ChannelsLast, is_channels_last, layout_summary, to_channels_last
from tests.helpers.plain_modules import Classifier, RandomImages, channels_last_strides, loader


def make_trainer(tmp_path, callbacks, **kw):
    kw = {"max_steps": 2, "limit_val_batches": 2, "num_sanity_val_steps": 0, "enable_checkpointing": False, **kw}
    return Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        **kw,
    )


def assert_all_channels_last(records):
    assert records, "nothing was recorded"
    for *stride, shape in records:
        assert tuple(stride) == channels_last_strides(shape), (stride, shape)


def test_fit_validate_test_predict_all_see_channels_last(tmp_path):
    model = Classifier()
    # 5 samples in batches of 2: the last batch is ragged, of size 1 (64 px so BatchNorm sees 2x2 maps)
    train, val = loader(5, 2, size=64), loader(5, 2)
    trainer = make_trainer(tmp_path, [ChannelsLast()], max_epochs=1, max_steps=-1, limit_val_batches=None)
    trainer.fit(model, train, val)
    trainer.validate(model, val)
    trainer.test(model, loader(3, 1))
    preds = trainer.predict(model, loader(3, 2))
    for stage in ("train", "val", "test", "predict"):
        assert_all_channels_last(model.seen[stage])
    assert [s[-1][0] for s in model.seen["train"]] == [2, 2, 1]
    assert layout_summary(model.net)["channels_last"] == 20 and "contiguous" not in layout_summary(model.net)
    assert [p.shape[0] for p in preds] == [2, 1]


class DictModule(LightningModule):
    """Takes dict batches with nested containers; records the layout of every tensor."""

    Pair = namedtuple("Pair", "a b")

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 4, 1)
        self.conv2 = nn.Conv2d(3, 4, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append({k: (v.stride(), v.shape) for k, v in _flatten(batch).items()})
        return self.conv(batch["video"]).mean() + self.conv2(batch["more"][0].b).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _flatten(batch):
    return {
        "video": batch["video"],
        "label": batch["label"],
        "mask4d": batch["more"][0].a,
        "image": batch["more"][0].b,
        "mask3d": batch["more"][1],
    }


def dict_collate(items):
    n = len(items)
    return {
        "video": torch.randn(n, 3, 2, 4, 4),
        "label": torch.arange(n),
        "name": "not a tensor",
        "more": [
            DictModule.Pair(torch.ones(n, 1, 4, 4, dtype=torch.long), torch.randn(n, 3, 4, 4)),
            torch.zeros(n, 4, 4, dtype=torch.bool),
        ],
    }


@pytest.mark.parametrize(
    "inputs, converted",
    [(None, ("video",)), ("all", ("video", "image")), (["video", "b"], ("video", "image"))],
    ids=["model-input", "all", "named"],
)
def test_nested_dict_batches_convert_only_floating_rank_4_and_5(tmp_path, inputs, converted):
    # by default only the image key at the top ("video"); "all" and names reach into the nesting
    model = DictModule()
    data = DataLoader(range(3), batch_size=2, collate_fn=dict_collate)
    make_trainer(tmp_path, [ChannelsLast(inputs=inputs)]).fit(model, data)
    assert model.seen
    for seen in model.seen:
        stride, shape = seen["video"]
        assert stride == torch.empty(shape, memory_format=torch.channels_last_3d).stride()
        stride, shape = seen["image"]
        assert stride == (channels_last_strides(shape) if "image" in converted else torch.empty(shape).stride())
        for untouched in ("label", "mask4d", "mask3d"):
            stride, shape = seen[untouched]
            assert stride == torch.empty(shape).stride(), untouched


def test_any_collection_lightning_moves_is_converted(tmp_path):
    # a UserList batch (a Sequence, not a list): Lightning's apply_to_collection carries it to the
    # device, so the callback must reach its tensors too (a hand-written list/tuple visitor did not)
    from collections import UserList

    from torch.utils.data import default_collate

    model = Classifier(net=nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4)))
    data = DataLoader(RandomImages(4), batch_size=2, collate_fn=lambda items: UserList(default_collate(items)))
    make_trainer(tmp_path, [ChannelsLast()]).fit(model, data)
    assert_all_channels_last(model.seen["train"])


def test_no_copy_when_batches_arrive_channels_last(tmp_path):
    made = []

    def cl_collate(items):
        x = torch.stack([i[0] for i in items]).to(memory_format=torch.channels_last)
        made.append(x.data_ptr())
        return x, torch.stack([i[1] for i in items])

    class PtrModule(Classifier):
        def training_step(self, batch, batch_idx):
            self.seen.setdefault("ptr", []).append(batch[0].data_ptr())
            return super().training_step(batch, batch_idx)

    model = PtrModule()
    make_trainer(tmp_path, [ChannelsLast()]).fit(model, DataLoader(RandomImages(4), batch_size=2, collate_fn=cl_collate))
    assert model.seen["ptr"] == made


class BuildsInHooks(Classifier):
    """Builds its network in ``configure_model`` (or ``setup``), as large-model code does."""

    def __init__(self, where: str):
        super().__init__(net=nn.Identity())
        self.where = where
        self.weight_strides = []

    def _build(self):
        if isinstance(self.net, nn.Identity):
            self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def setup(self, stage):
        if self.where == "setup":
            self._build()

    def configure_model(self):
        if self.where == "configure_model":
            self._build()

    def training_step(self, batch, batch_idx):
        self.weight_strides.append((self.net[0].weight.stride(), self.net[1].weight.stride()))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("where", ["configure_model", "setup"])
def test_layers_built_in_setup_or_configure_model_are_converted(tmp_path, where):
    model = BuildsInHooks(where)
    make_trainer(tmp_path, [ChannelsLast()]).fit(model, loader(4, 2))
    assert model.weight_strides, "training_step did not run"
    for s3x3, s1x1 in model.weight_strides:
        assert s3x3 == channels_last_strides((8, 3, 3, 3))
        assert s1x1 == channels_last_strides((8, 8, 1, 1))  # ambiguous NC11 shape gets real strides
    assert "setup" not in model.__dict__ and "configure_model" not in model.__dict__  # hooks restored


def test_conv_mode_and_off_mode(tmp_path):
    class WithPos(Classifier):
        def __init__(self):
            super().__init__(net=torchvision.models.resnet18(num_classes=4))
            self.pos = nn.Parameter(torch.zeros(1, 3, 32, 32))

        def forward(self, x):
            return self.net(x + self.pos)

    conv = WithPos()
    make_trainer(tmp_path, [ChannelsLast(mode="conv")]).fit(conv, loader(4, 2))
    assert is_channels_last(conv.net.conv1.weight) and conv.pos.is_contiguous()
    assert_all_channels_last(conv.seen["train"])

    off = WithPos()
    make_trainer(tmp_path, [ChannelsLast(mode="off")]).fit(off, loader(4, 2))
    assert layout_summary(off).get("channels_last", 0) == 0
    for *stride, shape in off.seen["train"]:
        assert tuple(stride) == torch.empty(shape).stride()


class _ViewsItsInput(Classifier):
    """An autoencoder's loss reads its input with ``view``, which a channels_last input refuses."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 0 * batch[0].view(len(batch[0]), -1).mean()


def test_convert_inputs_false_leaves_batches_and_its_check_runs_the_step_on_them(tmp_path):
    # the check converted the copies' inputs all the same: a step that views them raised in channels_last only,
    # and the model went to NCHW for a fault the run never meets
    model = _ViewsItsInput()
    make_trainer(tmp_path, [ChannelsLast(convert_inputs=False, layout="channels_last")]).fit(model, loader(4, 2))
    assert is_channels_last(model.net.conv1.weight)
    assert all(tuple(s) == torch.empty(shape).stride() for *s, shape in model.seen["train"])


class _WritesALog(Classifier):
    """The guide's pattern: an open file on the module, written outside the check's copies; a head written for NCHW."""

    def __init__(self, path):
        from tests.helpers.user_code import ViewHead

        super().__init__(ViewHead())
        self.sample_log = open(path, "a")  # noqa: SIM115 - the module holds it for the run

    def training_step(self, batch, batch_idx):
        from cltrain.check import is_check_copy

        if not is_check_copy(self):
            self.sample_log.write(f"{batch_idx}\n")
        return super().training_step(batch, batch_idx)


def test_a_module_holding_an_open_file_is_checked_sharing_it_with_the_copies(tmp_path):
    # deepcopy refuses an open file (a SummaryWriter's lock likewise): the check was skipped, and the head's view
    # raised at the first real step
    model = _WritesALog(tmp_path / "samples.log")
    callback = ChannelsLast(layout="channels_last")
    make_trainer(tmp_path, [callback]).fit(model, loader(4, 2, size=16))
    model.sample_log.close()
    check = callback.layout_checks["train"]
    assert check.verdict == "fallback", check.line()
    assert "shared with the copies: self.sample_log (TextIOWrapper)" in check.line() and "_trainer" not in check.line()
    assert (tmp_path / "samples.log").read_text() == "0\n1\n"  # the real steps' lines alone


@pytest.mark.parametrize("finder", ["Tuner.scale_batch_size", "LearningRateFinder"])
def test_lightnings_finders_run_their_trials_in_nchw_and_the_fit_in_channels_last(finder, caplog):
    # the finders run their trial steps with no callback, so no check and no fallback: a head that views the
    # convolution's output raised there in channels_last
    from lightning.pytorch.callbacks import LearningRateFinder
    from lightning.pytorch.tuner import Tuner

    from tests.helpers.user_code import Classifier as ViewClassifier
    from tests.helpers.user_code import ViewHead

    class Module(ViewClassifier):
        def __init__(self) -> None:
            super().__init__(ViewHead())
            self.batch_size, self.lr = 4, 0.05

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(0)
            images, labels = torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 5, (32,), generator=g)
            return DataLoader(list(zip(images, labels)), batch_size=self.batch_size)

    module, callback = Module(), ChannelsLast(layout="channels_last")
    finders = [LearningRateFinder(num_training_steps=4)] if finder == "LearningRateFinder" else []
    trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, *finders])
    with caplog.at_level(logging.INFO):
        if finder == "Tuner.scale_batch_size":
            Tuner(trainer).scale_batch_size(module, max_trials=2)
        trainer.fit(module)
    assert "takes them in NCHW" in caplog.text and callback.layout_checks["train"].verdict == "fallback"
    assert is_channels_last(module.net.conv1.weight)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "fast"}, "mode='fast'"),
        ({"convert_inputs": "yes"}, "convert_inputs='yes'"),
        ({"inputs": 1.5}, r"ChannelsLast\(inputs=1.5\)"),
        ({"inputs": []}, r"ChannelsLast\(inputs=\[\]\)"),
        ({"inputs": ["all", 0]}, r"ChannelsLast\(inputs=\['all', 0\]\)"),
        ({"inputs": True}, r"ChannelsLast\(inputs=True\)"),
        ({"layout": "nhwc"}, "layout='nhwc'"),
        ({"check_samples": 0}, "check_samples=0"),
    ],
)
def test_bad_arguments_are_rejected_with_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ChannelsLast(**kwargs)


def test_warns_when_the_model_has_no_convolution_and_neither_races_nor_converts_its_inputs(tmp_path):
    model = Classifier(net=nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4)))
    callback = ChannelsLast()
    trainer = make_trainer(tmp_path, [callback])
    with pytest.warns(UserWarning, match="no Conv2d/Conv3d"):
        trainer.fit(model, loader(4, 2))
    # both layouts would time the same steps; the first step's input traced, then left as it arrives
    assert callback.session.untimed == "the model has no convolution"
    assert all(tuple(s) == torch.empty(shape).stride() for *s, shape in model.seen["train"][1:])
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        trainer.validate(model, loader(2, 2))
    assert not [w for w in again if "no Conv2d/Conv3d" in str(w.message)]  # once, not at every setup


def test_logs_what_it_converted(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        make_trainer(tmp_path, [ChannelsLast()]).fit(Classifier(), loader(4, 2))
    text = caplog.text
    assert "model layout is channels_last; the first training steps race it" in text and "20 channels_last" in text
    assert "converting 1 tensor(s) per batch" in text
    caplog.clear()
    with caplog.at_level(logging.INFO):  # an evaluation alone: no training step to race
        make_trainer(tmp_path, [ChannelsLast()]).validate(Classifier(), loader(4, 2))
    assert "model layout is channels_last; parameters" in caplog.text and "race" not in caplog.text
    caplog.clear()
    model, trainer = Classifier(), make_trainer(tmp_path, [ChannelsLast(layout="channels_last")])
    with caplog.at_level(logging.INFO):  # every stage's setup said it again: 9 lines for fit, validate, test, ...
        trainer.validate(model, loader(4, 2))
        trainer.fit(model, loader(4, 2))
        for _ in range(2):
            trainer.validate(model, loader(4, 2))
            trainer.test(model, loader(4, 2))
    assert sum("model layout is channels_last" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_checkpoint_loads_into_a_plain_torchvision_model(tmp_path):
    model = Classifier()
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="last")
    trainer = make_trainer(tmp_path, [ChannelsLast(), ckpt], enable_checkpointing=True, max_steps=3)
    trainer.fit(model, loader(8, 4))
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]
    assert is_channels_last(state["net.conv1.weight"])  # saved as trained
    plain = torchvision.models.resnet18(num_classes=4)
    plain.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})
    assert plain.conv1.weight.is_contiguous() and not is_channels_last(plain.conv1.weight)
    x = torch.randn(2, 3, 32, 32)
    model.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model(to_channels_last(x)), rtol=1e-4, atol=1e-5)


class OptimizerStateProbe(Callback):
    """Records the strides of parameters and SGD momentum buffers when training starts."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if hasattr(self, "params"):
            return
        opt = trainer.optimizers[0]
        self.step = trainer.global_step
        self.params = {n: p.stride() for n, p in pl_module.named_parameters() if p.dim() == 4}
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.momentum = {
            names[id(p)]: s["momentum_buffer"].stride() for p, s in opt.state.items() if p.dim() == 4
        }


@pytest.mark.parametrize("first_run_channels_last", [True, False], ids=["from-cl-ckpt", "from-nchw-ckpt"])
def test_resume_keeps_parameters_and_momentum_channels_last(tmp_path, first_run_channels_last):
    first = [ChannelsLast()] if first_run_channels_last else []
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="last")
    make_trainer(tmp_path, first + [ckpt], enable_checkpointing=True, max_steps=2).fit(Classifier(), loader(8, 4))

    probe = OptimizerStateProbe()
    resumed = Classifier()
    trainer = make_trainer(tmp_path / "resume", [ChannelsLast(), probe], max_steps=4)
    trainer.fit(resumed, loader(8, 4), ckpt_path=tmp_path / "last.ckpt")
    assert probe.step == 2 and trainer.global_step == 4
    assert len(probe.momentum) == 20
    for name, stride in probe.params.items():
        shape = dict(resumed.named_parameters())[name].shape
        assert stride == channels_last_strides(shape), name
        assert probe.momentum[name] == stride, name


class Mixed2d3d(Classifier):
    def __init__(self):
        super().__init__(net=nn.Identity())
        self.conv2d = nn.Conv2d(3, 4, 3, padding=1)
        self.conv3d = nn.Conv3d(1, 2, 3, padding=1)
        self.fc = nn.Linear(4 + 2, 4)

    def forward(self, x):
        h = self.conv2d(x)  # (N, 4, H, W) -> treat channels as depth for the 3-D conv
        v = self.conv3d(h.unsqueeze(1))
        return self.fc(torch.cat([h.mean((2, 3)), v.mean((2, 3, 4))], 1))


def test_mixed_2d_3d_model_trains(tmp_path):
    model = Mixed2d3d()
    make_trainer(tmp_path, [ChannelsLast()]).fit(model, loader(4, 2))
    assert is_channels_last(model.conv2d.weight) and is_channels_last(model.conv3d.weight)
    assert model.conv3d.weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert all(torch.isfinite(torch.tensor(model.losses)))


def test_timm_model_in_a_plain_module(tmp_path):
    timm = pytest.importorskip("timm")
    model = Classifier(net=timm.create_model("resnet10t", num_classes=4, pretrained=False))
    trainer = make_trainer(tmp_path, [ChannelsLast()])
    trainer.fit(model, loader(4, 2), loader(2, 2))
    trainer.test(model, loader(2, 2))
    trainer.predict(model, loader(2, 2))
    for stage in ("train", "val", "test", "predict"):
        assert_all_channels_last(model.seen[stage])
    assert "contiguous" not in layout_summary(model.net)


def test_the_check_runs_without_cudnn_autotuning_and_the_run_keeps_it(tmp_path, monkeypatch):
    # the check's once-only runs (float32, both layouts, its own batch size) would each autotune every convolution
    # under cudnn.benchmark; the user's steps keep the setting (Trainer(benchmark=True) sets it on any device)
    from cltrain.check.copies import checking

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)  # restored after the test
    flags = []  # outside the module: the check's copies are deep copies

    class Records(Classifier):
        def training_step(self, batch, batch_idx):
            flags.append((checking(), torch.backends.cudnn.benchmark))
            return super().training_step(batch, batch_idx)

    model = Records(torchvision.models.resnet18(num_classes=4))
    Trainer(accelerator="cpu", max_steps=2, benchmark=True, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
            callbacks=[ChannelsLast()]).fit(model, loader(n=8))
    assert (True, False) in flags and (True, True) not in flags
    assert [f for f in flags if not f[0]] == [(False, True)] * 2 and torch.backends.cudnn.benchmark

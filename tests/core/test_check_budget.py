"""The first-batch layout check on a slice of the batch: it finds what the whole batch finds, falls back to the
whole batch for code written for the batch size, and an out-of-memory error inside it is never a verdict."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cltrain import ChannelsLast, is_channels_last
from cltrain.check import checking
from cltrain.check.budget import slice_batch
from tests.helpers.user_code import PATTERNS, Classifier, Net

BATCH = 8
# The most samples a copy of the model may run in the check before "memory runs out" (see OutOfMemoryAbove).
_LIMIT = {"samples": None}


def fit(module: pl.LightningModule, data: DataLoader, callback: ChannelsLast, steps: int = 1) -> None:
    pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[callback, _MemoryFreedForTheStep()]).fit(module, data)


def loader(pattern: str = "") -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * BATCH, 3, 16, 16, generator=g)
    y = torch.randn(2 * BATCH, 4, 16, 16, generator=g) if pattern == "loss_view" else \
        torch.randint(0, 5, (2 * BATCH,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def test_slice_batch_cuts_the_tensors_with_the_batch_size_only():
    images, labels, weights = torch.randn(8, 3, 4, 4), torch.arange(8), torch.ones(5)
    part = slice_batch({"image": images, "label": labels, "weights": weights, "name": "x"}, 2, 8)
    assert part["image"].shape == (2, 3, 4, 4) and part["label"].tolist() == [0, 1]
    assert part["weights"] is weights and part["name"] == "x"


@pytest.mark.parametrize("pattern", ["view_head", "raw_memory", "loss_view"])  # raises, diverges, the step code
def test_two_samples_find_what_the_whole_batch_finds(pattern):
    found = {}
    for samples in (2, None):
        torch.manual_seed(0)
        callback = ChannelsLast(check_samples=samples)
        fit(PATTERNS[pattern](), loader(pattern), callback)
        check = callback.layout_checks["train"]
        assert check.verdict in ("fallback", "contiguous"), check.line()
        # Where the fallback was timed against the contiguous model, the faster of the two on this machine wins.
        if check.timings is not None:
            faster = min(check.timings, key=check.timings.get)
            assert check.verdict == ("contiguous" if faster == "contiguous" else "fallback"), check.timings
        choice = (check.verdict, check.fallbacks) if check.timings is None else "timed"
        found[samples] = (choice, [(f.kind, f.phase, f.module) for f in check.findings])
    assert found[2] == found[None], found


class BatchSizedView(nn.Module):
    """Code written for the batch size: ``x.view(BATCH, -1)`` raises on any other number of samples, in both layouts,
    and on the whole batch only in channels_last."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 16 * 16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).view(BATCH, -1))


def test_code_written_for_the_batch_size_is_checked_on_the_whole_batch():
    callback = ChannelsLast()  # a 4-sample part raises in NCHW too
    module = Classifier(BatchSizedView())
    fit(module, loader(), callback, steps=2)
    check = callback.layout_checks["train"]
    assert check.verdict in ("fallback", "contiguous") and "view" in check.findings[0].detail, check.line()
    assert len(module.losses) == 2


class Recorded(Classifier):
    """Records the batch size of every step the check runs on its copies; with ``sets_trainer``, the step sets
    ``trainer.should_stop`` (which a copy may not) before calling the model."""

    def __init__(self, net: nn.Module, sets_trainer: bool = False) -> None:
        super().__init__(net)
        self.sets_trainer = sets_trainer

    def training_step(self, batch, batch_idx):
        if checking():
            _SEEN.append(batch[0].shape[0])
        if self.sets_trainer:
            self.trainer.should_stop = False
        scale = 1.0 / self.trainer.strategy.world_size  # read as on the real run
        return super().training_step(batch, batch_idx) * scale


_SEEN: list[int] = []


def test_only_code_written_for_the_batch_size_sends_the_check_to_the_whole_batch():
    runs = {}
    cases = (("sets", Recorded(Net(nn.Identity()), sets_trainer=True)), ("batch-sized", Recorded(BatchSizedView())))
    for name, module in cases:
        _SEEN.clear()
        callback = ChannelsLast()
        fit(module, loader(), callback, steps=2)
        runs[name] = (callback.layout_checks["train"], sorted(set(_SEEN)))
        assert len(module.losses) == 2
    sets, _ = runs["sets"]
    assert sets.verdict == "passed" and "the model alone" in sets.line(), sets.line()
    assert "trainer.should_stop cannot be set" in sets.line(), sets.line()
    assert runs["sets"][1] == [4], runs  # the copy's limit: not rerun on the whole batch
    assert runs["batch-sized"][1] == [4, BATCH], runs  # the negative control: rerun on the whole batch
    assert "view" in runs["batch-sized"][0].findings[0].detail


class OutOfMemoryAbove(nn.Module):
    """Raises ``torch.OutOfMemoryError`` on more than ``_LIMIT["samples"]`` samples, in channels_last only (or in
    both layouts with ``both``): memory that the check's copies would lack and the real step has."""

    def __init__(self, both: bool = False) -> None:
        super().__init__()
        self.both = both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        limit = _LIMIT["samples"]
        if limit is not None and x.shape[0] > limit and (self.both or is_channels_last(x)):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({x.shape[0]} samples)")
        return x


class _MemoryFreedForTheStep(Callback):
    """After ChannelsLast's hook (the check): the real step has the memory the check's copies held."""

    def on_train_batch_start(self, *args, **kwargs) -> None:
        _LIMIT["samples"] = None


@pytest.mark.parametrize("limit, both, verdict", [(2, False, "passed"), (1, False, "not checked"),
                                                  (1, True, "not checked")])
def test_out_of_memory_in_the_check_is_never_a_verdict_and_the_run_trains(limit, both, verdict):
    _LIMIT["samples"] = limit
    callback = ChannelsLast()
    module = Classifier(Net(OutOfMemoryAbove(both)))
    fit(module, loader(), callback, steps=2)
    check = callback.layout_checks["train"]
    assert check.verdict == verdict and not check.fallbacks, check.line()
    if verdict == "not checked":
        assert "out of memory at 2 samples" in check.reason, check.reason
    assert callback.layout == "channels_last" and is_channels_last(module.net.stem.weight)
    assert len(module.losses) == 2 and all(l == l for l in module.losses)


def test_check_samples_is_validated():
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="check_samples"):
            ChannelsLast(check_samples=bad)


_CHECKED: list[int] = []  # the batch size of each forward the check ran (a copy's attribute would be a copy)


class _SeenInCheck(nn.Module):
    """A small conv net that notes the batch size of each forward the check runs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))

    def forward(self, pixel_values, labels=None):
        if checking():
            _CHECKED.append(pixel_values.shape[0])
        logits = self.body(pixel_values)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits} if labels is not None else logits


@pytest.mark.parametrize("door", ["accelerate", "hf"])
@pytest.mark.parametrize("samples", [2, None])
def test_the_hugging_face_doors_check_as_many_samples_as_asked(door, samples, tmp_path):
    pytest.importorskip("transformers")
    model, _CHECKED[:] = _SeenInCheck(), []
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 2, (6,))
    if door == "accelerate":
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState

        from cltrain.integrations.accelerate import prepare_channels_last

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        prepare_channels_last(model, Accelerator(cpu=True), layout="channels_last", check_samples=samples)
        model(pixel_values=x, labels=y)["loss"].backward()
    else:
        from transformers import Trainer, TrainingArguments

        from cltrain.integrations.transformers import ChannelsLastCallback

        args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=6, use_cpu=True,
                                 report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
        rows = [{"pixel_values": x[i], "labels": y[i]} for i in range(6)]
        Trainer(model=model, args=args, train_dataset=rows,
                callbacks=[ChannelsLastCallback(layout="channels_last", check_samples=samples)]).train()
    assert _CHECKED and set(_CHECKED) == {samples or 6}, _CHECKED


def test_slice_batch_cuts_a_detectors_lists_below_the_batch():
    # each sample whole: 3 images of 3 channels with 3 boxes each were cut to 2 channels and 2 boxes
    images, targets = tuple(torch.randn(3, 4, 4) for _ in range(8)), [{"boxes": torch.ones(3, 4)} for _ in range(8)]
    part = slice_batch((images, targets, torch.arange(8), ["a"] * 5), 4, 8)
    assert len(part) == 4 and isinstance(part[0], tuple) and len(part[0]) == 4 and len(part[1]) == 4
    assert part[1][0]["boxes"].shape == (3, 4) and part[2].tolist() == [0, 1, 2, 3] and len(part[3]) == 5
    part = slice_batch((images[:3], targets[:3], torch.arange(3)), 2, 3)
    assert [t.shape for t in part[0]] == [(3, 4, 4)] * 2 and [t["boxes"].shape for t in part[1]] == [(3, 4)] * 2
    assert part[2].tolist() == [0, 1]


class _Detector(nn.Module):
    """A detector's call (``model(images, labels)``, a list of 3-D images) that records how many images the check's
    copies get."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 3)

    def forward(self, images: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        if checking():
            _SEEN.append(len(images))
        h = torch.relu(self.conv(torch.stack(images))).mean((2, 3))
        return nn.functional.cross_entropy(self.fc(h), labels)


@pytest.mark.parametrize("door", ["lightning", "accelerate"])
def test_a_detectors_list_of_images_is_checked_on_check_samples_of_them(door):
    # the whole list was checked: a detector's first batch took several training steps' time
    _SEEN.clear()
    torch.manual_seed(0)
    model = _Detector()
    images, labels = [torch.randn(3, 8, 8) for _ in range(BATCH)], torch.randint(0, 3, (BATCH,))
    if door == "lightning":
        from tests.helpers.plain_modules import NetCall

        fit(NetCall(model), DataLoader([(images, labels)], batch_size=None), ChannelsLast(layout="channels_last"))
    else:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState

        from cltrain.integrations.accelerate import prepare_channels_last

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        prepare_channels_last(model, Accelerator(cpu=True), layout="channels_last")
        model(images, labels).backward()
    assert _SEEN and set(_SEEN) == {4}, _SEEN

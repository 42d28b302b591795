"""Numerical parity: channels_last training follows the contiguous (NCHW) run.

Tolerance, and why. Both runs do the same arithmetic in a different summation order (oneDNN
picks other kernels for NHWC), so they differ by float32 rounding only: from identical weights
the loss agrees to ~5e-7 relative and every gradient to ~5e-6 (measured on this CPU; a
contiguous run repeated is bitwise identical, so all of that difference is layout). Each SGD step
then feeds those differences back through BatchNorm on batches of 8, which amplifies them: over 5
steps at lr 0.01 the losses drifted apart by at most 2.3e-3 relative. So: step 1 within 1e-5,
steps 2-5 within 1e-2 (4x the drift seen). A real layout bug is O(1): the control below, the
same pixels read in the wrong order, moves the very first loss by more than 1e-2.
"""

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from cltrain import ChannelsLast
from tests.helpers.plain_modules import Classifier, loader


class ScrambleInputs(Callback):
    """A layout bug on purpose: reinterpret each NCHW image's memory as if it were NHWC."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        x = batch[0]
        x.data = x.data.reshape(x.shape[0], x.shape[2], x.shape[3], x.shape[1]).permute(0, 3, 1, 2).contiguous()


def five_step_losses(callbacks) -> torch.Tensor:
    seed_everything(0)
    model = Classifier(lr=0.01)
    Trainer(
        accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, deterministic=True,
    ).fit(model, loader(40, 8, size=64))
    assert len(model.losses) == 5
    return torch.tensor(model.losses, dtype=torch.float64)


def test_five_fp32_steps_agree_with_contiguous():
    ref = five_step_losses([])
    cl = five_step_losses([ChannelsLast()])
    rel = (cl - ref).abs() / ref.abs()
    assert rel[0] < 1e-5, rel
    assert (rel[1:] < 1e-2).all(), rel

    wrong = five_step_losses([ScrambleInputs()])
    assert ((wrong[0] - ref[0]).abs() / ref[0]) > 1e-2

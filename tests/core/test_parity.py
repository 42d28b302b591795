"""Numerical parity: channels_last training follows the contiguous (NCHW) run.

Tolerance, and why. Both runs do the same arithmetic in a different summation order (oneDNN
picks other kernels for NHWC), so they differ by float32 rounding only: from identical weights
the first loss agrees to ~5e-7 relative. Each SGD step then feeds those differences back through
BatchNorm on batches of 8, which amplifies them: by step 5 the losses drift apart by up to 1e-2
relative on an AMX Xeon and 2.5e-2 with the kernels held to AVX2, and so does the NCHW run with
its weights nudged by 1e-7 (the noise reference). So: step 1 within 1e-5, steps 2-5 within 10x
the nudged run's drift. A real layout bug is O(1): the control below, the same pixels read in
the wrong order, moves the very first loss by more than 1e-2.
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


class Nudge(Callback):
    """The noise reference: every weight times ``1 + 1e-7 * randn`` before the first step."""

    def on_fit_start(self, trainer, pl_module):
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in pl_module.parameters():
                p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=gen))


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
    noise = ((five_step_losses([Nudge()]) - ref).abs() / ref.abs())[1:].max()
    rel = (cl - ref).abs() / ref.abs()
    assert rel[0] < 1e-5, rel
    assert (rel[1:] <= 10 * max(noise, 1e-6)).all(), (rel, noise)

    wrong = five_step_losses([ScrambleInputs()])
    assert ((wrong[0] - ref[0]).abs() / ref[0]) > 1e-2

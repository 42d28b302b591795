"""Train one Hugging Face model (``tests.helpers.hf_models``) under a real ``transformers.Trainer``, with and
without ``ChannelsLastCallback``, and print what the tests compare as one JSON line.

Run as ``python -m tests.helpers.hf_trainer_run MODEL OUTDIR``. The runs, all from the same weights and data:

* ``nchw``: no callback; ``callback``: with it, saving ``checkpoint-2`` on the way and the model at the end;
* ``resumed``: a new Trainer with the callback resuming ``checkpoint-2`` (step 3 only);
* ``recipe``: the usual advice, ``model.to(memory_format=torch.channels_last)`` before ``Trainer``, one step;
* ``reloaded``: the saved model loaded by ``from_pretrained`` into a model without the callback.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cltrain.layout import is_channels_last
from tests.helpers.hf_models import build, dataset


class Probe:
    """Records every training forward's loss and whether the first convolution got a channels_last input."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.losses: list[float] = []
        self.first_conv_input: list[bool] = []  # one per call of the first convolution, training or not
        conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        # Copies of the model (the layout check's) carry this hook too: only the real convolution counts.
        conv.register_forward_pre_hook(torch.compiler.disable(
            lambda m, args: self.first_conv_input.append(is_channels_last(args[0])) if m is conv else None))
        model.register_forward_hook(self._loss)

    @torch.compiler.disable
    def _loss(self, model: nn.Module, args: Any, output: Any) -> None:
        loss = output.get("loss") if isinstance(output, dict) else None
        if model is self.model and model.training and loss is not None:
            self.losses.append(loss.item())


def conv_weights(model: nn.Module) -> dict[str, bool]:
    """Each convolution's weight: channels_last or not."""
    return {name: is_channels_last(m.weight) for name, m in model.named_modules() if isinstance(m, nn.Conv2d)}


def trainer(name: str, out: Path, model: nn.Module | None, callbacks: list, model_init: Any = None,
            **overrides: Any) -> Any:
    """A Trainer on ``name``'s generated data: 3 SGD steps of batch 4 on the CPU; ``overrides`` go to its arguments."""
    from transformers import Trainer, TrainingArguments

    options = dict(output_dir=str(out), max_steps=3, per_device_train_batch_size=4, learning_rate=0.05,
                   logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                   dataloader_num_workers=0, disable_tqdm=True, optim="sgd", optim_args="momentum=0.9")
    options.update(overrides)
    return Trainer(model=model, model_init=model_init, args=TrainingArguments(**options), train_dataset=dataset(name),
                   eval_dataset=dataset(name, n=8, seed=2), callbacks=callbacks)


def run(name: str, out: Path) -> dict[str, Any]:
    from cltrain.integrations.transformers import ChannelsLastCallback

    results: dict[str, Any] = {}

    model = build(name)
    probe = Probe(model)
    trainer(name, out / "nchw", model, []).train()
    results["nchw"] = {"losses": probe.losses, "first_conv_input": probe.first_conv_input}

    model, callback = build(name), ChannelsLastCallback()
    probe = Probe(model)
    t = trainer(name, out / "cl", model, [callback], save_strategy="steps", save_steps=2)
    t.train()
    t.save_model(str(out / "cl" / "final"))
    guarded = sorted({m for r in callback.guardrails or [] for m in r.modules})
    results["callback"] = {"losses": probe.losses, "first_conv_input": probe.first_conv_input,
                           "conv_weights": conv_weights(model), "guarded": guarded,
                           "check": callback.layout_checks["train"].verdict}
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}

    model = build(name, seed=1)  # other weights: the checkpoint must bring the trained ones
    probe = Probe(model)
    t = trainer(name, out / "cl", model, [ChannelsLastCallback()])
    t.train(resume_from_checkpoint=str(out / "cl" / "checkpoint-2"))
    weight_of = {id(p): n for n, p in model.named_parameters()}
    state_cl = {weight_of[id(p)]: is_channels_last(s["momentum_buffer"]) for p, s in t.optimizer.state.items()
                if p.dim() == 4}
    results["resumed"] = {"losses": probe.losses, "first_conv_input": probe.first_conv_input,
                          "conv_weights": conv_weights(model), "optimizer_state": state_cl}

    model = build(name).to(memory_format=torch.channels_last)
    probe = Probe(model)
    trainer(name, out / "recipe", model, [], max_steps=1).train()
    results["recipe"] = {"first_conv_input": probe.first_conv_input, "conv_weights": conv_weights(model)}

    reloaded = type(model).from_pretrained(str(out / "cl" / "final"))
    state = reloaded.state_dict()
    results["reloaded"] = {
        "contiguous": all(t.is_contiguous() for t in state.values()),
        "max_diff": max((state[k].float() - v.float()).abs().max().item() for k, v in trained.items() if k in state),
        "missing": sorted(set(trained) - set(state)),
    }
    return results


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(json.dumps(run(sys.argv[1], Path(sys.argv[2]))))

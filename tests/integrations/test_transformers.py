"""ChannelsLastCallback under a real transformers.Trainer, on Hugging Face models built from their configs."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from cltrain import is_channels_last  # noqa: E402
from cltrain.integrations.transformers import ChannelsLastCallback  # noqa: E402
from tests.helpers import REPO  # noqa: E402
from tests.helpers.hf_models import build  # noqa: E402
from tests.helpers.hf_trainer_run import Probe, conv_weights, trainer  # noqa: E402
from tests.helpers import warm

# transformers 5.24 saves Segformer under its legacy key names and Trainer's resume loads them with
# load_state_dict(strict=False): the resumed Segformer starts from its own weights, with or without cltrain.
RESUMES_WEIGHTS = {"convnext", "resnet", "regnet", "timm"}


def _run_model(name: str, tmp_path: Path) -> dict:
    proc = warm.run([sys.executable, "-m", "tests.helpers.hf_trainer_run", name, str(tmp_path)],
                    cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [
    "resnet", "convnext", "segformer",
    pytest.param("timm", marks=pytest.mark.slow),
])
def test_model_trains_channels_last_with_the_same_losses_and_checkpoints(name, tmp_path):
    if name == "timm":
        pytest.importorskip("timm")
    r = _run_model(name, tmp_path)
    nchw, cl, resumed = r["nchw"], r["callback"], r["resumed"]
    assert nchw["first_conv_input"] == [False] * 3
    assert cl["first_conv_input"] == [True] * 3  # inputs reach the first convolution channels_last
    torch.testing.assert_close(cl["losses"], nchw["losses"], rtol=1e-4, atol=1e-6)
    assert cl["check"] == "passed"
    assert {k for k, ok in cl["conv_weights"].items() if not ok} <= set(cl["guarded"])
    # checkpoint-2 resumed by a new Trainer: layout kept, optimizer state in its parameters' layout
    assert resumed["first_conv_input"] == [True]
    assert resumed["conv_weights"] == cl["conv_weights"]
    assert resumed["optimizer_state"] and all(resumed["optimizer_state"].values())
    if name in RESUMES_WEIGHTS:
        torch.testing.assert_close(resumed["losses"], cl["losses"][2:], rtol=1e-5, atol=1e-6)
    # save_model -> from_pretrained into a model without cltrain: plain NCHW tensors, the trained values
    assert r["reloaded"] == {"contiguous": True, "max_diff": 0.0, "missing": []}
    # the usual advice converts the weights only: the inputs stay NCHW
    assert all(r["recipe"]["conv_weights"].values()) and r["recipe"]["first_conv_input"] == [False]


def test_model_init_builds_the_model_in_train_and_it_is_converted(tmp_path):
    probes: list[Probe] = []

    def model_init() -> nn.Module:
        model = build("resnet")
        probes.append(Probe(model))
        return model

    callback = ChannelsLastCallback()
    t = trainer("resnet", tmp_path, None, [callback], max_steps=2, model_init=model_init)
    t.train()
    assert len(probes) == 2 and t.model is probes[1].model  # built in __init__, built again in train()
    assert probes[1].first_conv_input == [True, True] and all(conv_weights(t.model).values())
    optimized = {id(p) for group in t.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in t.model.parameters()}  # converted in place: the optimizer's own parameters
    assert callback.layout_checks["train"].verdict == "passed"


def test_a_search_s_second_trial_is_checked_as_a_new_run_not_a_resume(tmp_path):
    # a fresh train()'s TrainerState holds the callbacks' own state(): the second trial read the first's as a
    # checkpoint's ("checked again: ... changed since the checkpoint")
    models = iter([PlainNet(), PlainNet(), FlattenWithView()])  # the Trainer builds one in __init__ too
    callback = ChannelsLastCallback(layout="channels_last")
    t = trainer("resnet", tmp_path, None, [callback], max_steps=1, model_init=lambda: next(models))
    t.train()
    assert callback.layout_checks["train"].verdict == "passed"
    t.train()
    check = callback.layout_checks["train"]
    assert check.verdict == "fallback" and not [n for n in check.notes if "checkpoint" in n], check.line()


def test_bf16_and_torch_compile(tmp_path):
    model, callback = build("resnet"), ChannelsLastCallback()
    probe = Probe(model)
    t = trainer("resnet", tmp_path, model, [callback], max_steps=6, bf16=True, torch_compile=True,
                torch_compile_backend="eager")
    t.train()
    assert type(t.model_wrapped).__name__ == "OptimizedModule"  # compiled after on_init_end converted the model
    # the race's first NCHW step would be the 6th: not raced, as each switch would compile the model again
    assert probe.first_conv_input == [True] * 6 and all(conv_weights(model).values())
    # known from torch_compile=True at the conversion: its line says so, and no race starts (a short run said the race
    # ended undecided, a long one only later that the steps were compiled)
    assert callback.session.untimed == "torch.compile would compile both layouts" and not callback.session.race.racing()
    assert callback.inputs_hook.autocast_dtype == torch.bfloat16
    assert len(probe.losses) == 6 and all(torch.isfinite(torch.tensor(probe.losses)))


def test_activation_checkpointing(tmp_path):  # TrainingArguments(gradient_checkpointing=True) is its old name
    model, reference = build("segformer"), build("segformer")
    probe, expected = Probe(model), Probe(reference)
    trainer("segformer", tmp_path, model, [ChannelsLastCallback()], max_steps=2, activation_checkpointing=True).train()
    trainer("segformer", tmp_path / "nchw", reference, [], max_steps=2).train()
    assert model.is_activation_checkpointing and probe.first_conv_input == [True, True]
    torch.testing.assert_close(probe.losses, expected.losses, rtol=1e-4, atol=1e-6)


class PlainNet(nn.Module):
    """A plain ``nn.Module`` (no ``save_pretrained``): the Trainer saves it with ``safetensors.torch.save_file``,
    which refuses a channels_last tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 3)

    def forward(self, pixel_values, labels=None):
        logits = self.head(F.relu(self.conv(pixel_values)).mean((2, 3)))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class SaveOn(TrainerCallback):
    """A user's callback listed after ours that asks for a save: after each evaluation (keeping only the best, say),
    at a step's end (as a SIGTERM handler does: save, then stop) or at an epoch's end."""

    def __init__(self, event: str) -> None:
        self.event = event

    def on_evaluate(self, args, state, control, **kwargs):
        control.should_save = self.event == "evaluate"

    def on_step_end(self, args, state, control, **kwargs):
        if self.event == "step" and state.global_step == 2:
            control.should_save = control.should_training_stop = True

    def on_epoch_end(self, args, state, control, **kwargs):
        control.should_save = control.should_save or self.event == "epoch"


@pytest.mark.parametrize("when", ["at each epoch's end", "before train()", "after an evaluation",
                                  "asked by a later callback at a step's end", "asked by a later callback at an epoch's end"])
def test_a_plain_module_is_saved_wherever_the_trainer_saves_it(when, tmp_path):
    from safetensors.torch import load_file

    model = PlainNet()
    saves = {"at each epoch's end": dict(save_strategy="epoch"),
             "after an evaluation": dict(eval_strategy="steps", eval_steps=2)}.get(when, {})
    event = {"after an evaluation": "evaluate", "asked by a later callback at a step's end": "step",
             "asked by a later callback at an epoch's end": "epoch"}.get(when)
    callbacks = [ChannelsLastCallback(), *[SaveOn(event)] * (event is not None)]
    t = trainer("resnet", tmp_path, model, callbacks, max_steps=4, **saves)
    if when == "before train()":
        t.save_model(str(tmp_path / "init"))
        assert set(load_file(tmp_path / "init" / "model.safetensors")) == set(model.state_dict())
    t.train()  # the saves at epoch ends and after evaluations raised "non contiguous tensor" before
    saved = sorted(tmp_path.glob("checkpoint-*/model.safetensors"))
    assert bool(saved) == (when != "before train()"), saved
    assert is_channels_last(model.conv.weight)  # the saves gave contiguous copies; the model kept its layout


class PutBack(TrainerCallback):
    """A user's callback after ours: keeps the weights of step 2 and writes them back in place through
    ``state_dict()`` at a later step's end and at the end of training (an EMA swap, a restore of the best)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            self.kept = {k: v.clone() for k, v in model.state_dict().items()}
        elif state.global_step == 3:
            self.put_back(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.put_back(model)

    def put_back(self, model):
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(self.kept[k])
        self.restored = all(torch.equal(v, self.kept[k]) for k, v in model.named_parameters())


def test_a_write_through_state_dict_reaches_the_model_and_the_saves_stay_contiguous(tmp_path):
    # the saves' contiguous copies were every state_dict()'s from a step's end until the next step's start and after
    # train(): a write through one did nothing to the channels_last weights (BatchNorm restored, the convs not)
    from safetensors.torch import load_file

    model, put_back = PlainNet(), PutBack()
    t = trainer("resnet", tmp_path, model, [ChannelsLastCallback(layout="channels_last"), put_back], max_steps=4,
                save_strategy="steps", save_steps=1)
    t.train()
    assert put_back.restored and is_channels_last(model.conv.weight)
    t.save_model(str(tmp_path / "final"))  # after train(), as users do
    final = load_file(tmp_path / "final" / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in put_back.kept.items())
    assert len(list(tmp_path.glob("checkpoint-*/model.safetensors"))) == 4


def test_a_run_saved_without_the_callback_resumes_with_it_and_saves_again(tmp_path):
    trainer("resnet", tmp_path, PlainNet(), [], max_steps=2, save_strategy="steps", save_steps=2).train()
    t = trainer("resnet", tmp_path, PlainNet(), [ChannelsLastCallback()], max_steps=4, save_strategy="steps",
                save_steps=2)
    t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))  # the save at step 4 raised KeyError before
    saved = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["ChannelsLastCallback"]["attributes"]["saved"], saved
    assert is_channels_last(t.model.conv.weight)


@pytest.mark.parametrize("restore", [False, True])
def test_a_resume_that_rebuilds_the_callback_from_the_checkpoint_says_whose_options_hold(tmp_path, caplog, restore):
    # restore_callback_states_from_checkpoint=True: transformers makes a new callback of the checkpoint's options,
    # in place of the one given (its layout, copies, check_samples): silently
    trainer("resnet", tmp_path, PlainNet(), [ChannelsLastCallback(check_samples=2, convert_inputs=False)], max_steps=2,
            save_strategy="steps", save_steps=2).train()
    given = ChannelsLastCallback(layout="contiguous")
    t = trainer("resnet", tmp_path, PlainNet(), [given], max_steps=3, save_strategy="no",
                restore_callback_states_from_checkpoint=restore)
    with caplog.at_level(logging.WARNING):
        t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    held = [cb for cb in t.callback_handler.callbacks if isinstance(cb, ChannelsLastCallback)]
    assert (held == [given]) is not restore
    assert (held[0].check_samples, held[0].convert_inputs) == ((2, False) if restore else (4, True))
    assert ("replaced the callback given to this Trainer" in caplog.text) is restore
    assert is_channels_last(t.model.conv.weight) is restore  # the checkpoint's layout='auto', or the given pin


def test_evaluate_and_predict_get_channels_last_inputs_and_the_same_outputs(tmp_path):
    model, reference = build("resnet"), build("resnet")
    probe = Probe(model)
    callback = ChannelsLastCallback()
    t = trainer("resnet", tmp_path, model, [callback])
    metrics = t.evaluate()
    prediction = t.predict(t.eval_dataset)
    assert probe.first_conv_input and all(probe.first_conv_input)
    assert callback.layout_checks["eval"].verdict == "passed" and "train" not in callback.layout_checks
    expected = trainer("resnet", tmp_path / "nchw", reference, []).predict(t.eval_dataset)
    torch.testing.assert_close(torch.as_tensor(prediction.predictions), torch.as_tensor(expected.predictions),
                               rtol=1e-4, atol=1e-5)
    assert metrics["eval_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-4)


def test_a_callback_added_after_the_trainer_was_made_says_what_ran_without_it(tmp_path, caplog):
    # trainer.add_callback(ChannelsLastCallback()): evaluate() and predict() ran in NCHW without a word (on_init_end,
    # where the model is converted, had passed); under DDP train() blamed a model_init the user never wrote
    model = build("resnet")
    t = trainer("resnet", tmp_path, model, [])
    callback = ChannelsLastCallback()
    t.add_callback(callback)
    with caplog.at_level(logging.WARNING):
        t.evaluate()
        t.predict(t.eval_dataset)
    said = [r.getMessage() for r in caplog.records if "added after Trainer.__init__" in r.getMessage()]
    assert len(said) == 1 and "this evaluate() ran in NCHW" in said[0], caplog.text
    t.train()
    assert all(conv_weights(model).values()) and callback.layout_checks["train"].verdict == "passed"


class FlattenWithView(nn.Module):
    """A model whose head assumes NCHW strides (``view`` merging C with H and W), as user code does."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 32 * 32, 3)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        features = self.conv(pixel_values)
        logits = self.fc(features.view(features.size(0), -1))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def test_the_first_batch_check_finds_code_assuming_nchw(tmp_path):
    torch.manual_seed(0)
    model, reference = FlattenWithView(), FlattenWithView()
    reference.load_state_dict(model.state_dict())
    callback = ChannelsLastCallback()
    probe, expected = Probe(model), Probe(reference)
    trainer("resnet", tmp_path, model, [callback], max_steps=2).train()
    trainer("resnet", tmp_path / "nchw", reference, [], max_steps=2).train()
    check = callback.layout_checks["train"]  # the fault is inside `conv`'s output: not timed, always this
    assert check.verdict == "fallback" and [f.module for f in check.fallbacks] == ["conv"], check.line()
    torch.testing.assert_close(probe.losses, expected.losses, rtol=1e-4, atol=1e-6)
    unchecked = FlattenWithView()
    with pytest.raises(RuntimeError, match="view"):  # without the check, channels_last breaks its view
        trainer("resnet", tmp_path / "off", unchecked, [ChannelsLastCallback(verify=False)], max_steps=1).train()


def test_a_training_check_after_an_evaluation_s_fallback_says_it_checked_with_it_on(tmp_path):
    torch.manual_seed(0)
    model, callback = FlattenWithView(), ChannelsLastCallback()
    t = trainer("resnet", tmp_path, model, [callback], max_steps=2)
    t.evaluate()  # the eval step's check finds the view and hands `conv`'s outputs on in NCHW
    t.train()
    checks = callback.layout_checks
    assert checks["eval"].verdict == "fallback" and checks["train"].verdict == "passed", checks
    assert "with the eval step's fallback on (the outputs of `conv` are handed on in NCHW)" in checks["train"].line()


@pytest.mark.parametrize("precision, dtype", [({}, None), ({"bf16": True}, torch.bfloat16),
                                              ({"fp16": True}, torch.float16)])
def test_events_leave_the_trainer_control_alone(precision, dtype):
    args = TrainingArguments("unused", use_cpu=True, report_to="none", **precision)
    control, callback, model = TrainerControl(), ChannelsLastCallback(), build("resnet")
    before = dict(vars(control))
    assert callback.on_init_end(args, TrainerState(), control, model=model) is None
    assert callback.on_train_begin(args, TrainerState(), control, model=model) is None
    assert vars(control) == before and all(conv_weights(model).values())
    assert callback.inputs_hook.autocast_dtype == dtype  # the dtype the guardrails and the check assume


@pytest.mark.parametrize("kwargs, named", [
    ({"mode": "auto"}, "mode='auto'"), ({"inputs": 3}, "inputs=3"), ({"inputs": []}, "inputs=[]"),
    ({"guard": "yes"}, "guard='yes'"), ({"verify": None}, "verify=None"),
])
def test_bad_arguments_are_named(kwargs, named):
    with pytest.raises(ValueError, match=re.escape(f"ChannelsLastCallback({named})")):
        ChannelsLastCallback(**kwargs)


def test_import_cltrain_imports_neither_transformers_nor_accelerate():
    code = ("import sys; import cltrain, cltrain.integrations, cltrain.integrations.inputs_hook\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'accelerate'}))\n"
            "sys.modules['transformers'] = None  # as if it were not installed\n"
            "try:\n    import cltrain.integrations.transformers\n"
            "except ImportError as error:\n    print(error)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.splitlines() == ["[]", "cltrain.integrations.transformers needs transformers: pip install "
                                        "'cltrain[hf]'."]
    assert not proc.stderr


@pytest.mark.slow
def test_ddp_rank_0_checks_and_every_rank_applies_its_choice(tmp_path):
    proc = warm.run([sys.executable, "-m", "tests.helpers.torchrun", "--standalone", "--nproc_per_node", "2",
                     "-m", "tests.helpers.hf_ddp_run", str(tmp_path)],
                    cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["checked"]["wrapped"] for r in ranks] == ["DistributedDataParallel"] * 2
    assert ranks[0]["verdict"] in ("fallback", "contiguous") and ranks[0]["fallbacks"]
    assert (ranks[0]["verdict"], ranks[0]["fallbacks"]) == (ranks[1]["verdict"], ranks[1]["fallbacks"])
    for rank in ranks:  # each rank's losses are the NCHW run's, and the ranks end with the same weights
        torch.testing.assert_close(rank["checked"]["losses"], rank["nchw"]["losses"], rtol=1e-4, atol=1e-6)
    assert ranks[0]["checked"]["weights"] == ranks[1]["checked"]["weights"]
    assert (proc.stdout + proc.stderr).count("ChannelsLast layout check:") == 1  # one line, from rank 0


_LEVELS = """
import sys
from cltrain.integrations.transformers import ChannelsLastCallback
from tests.helpers.hf_models import build
from tests.helpers.hf_trainer_run import trainer

for level in ("passive", "warning"):  # the Trainer's default, then a level the user set
    print(f"=== {level}", file=sys.stderr, flush=True)
    trainer("resnet", f"{sys.argv[1]}/{level}", build("resnet"), [ChannelsLastCallback(layout="channels_last")],
            max_steps=1, log_level=level).train()
"""


def test_the_lines_show_at_the_trainers_default_level_and_follow_a_level_the_user_set(tmp_path):
    # transformers' default verbosity is warning: through its logger, every line (the conversion, the check's verdict,
    # the race's decision) was hidden unless the user asked for info
    proc = warm.run([sys.executable, "-c", _LEVELS, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                    timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    default, warning = proc.stderr.split("=== passive", 1)[1].split("=== warning", 1)
    assert "ChannelsLastCallback(mode='full'): model layout is channels_last" in default, default[-2000:]
    assert "layout check passed" in default, default[-2000:]
    assert "ChannelsLast" not in warning, warning[-2000:]

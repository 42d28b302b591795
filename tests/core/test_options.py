"""cltrain.options: every front door refuses a bad argument in the same words, before it touches anything."""

from __future__ import annotations

import re

import pytest

from cltrain import ChannelsLast
from cltrain.loops import convert_model
from cltrain.options import check_flags, check_layout_choice, check_mode, check_positive


def _front_doors() -> dict:
    doors = {"ChannelsLast": lambda **kw: ChannelsLast(**kw),
             "convert_model": lambda **kw: convert_model(__import__("torch").nn.Conv2d(3, 4, 3), **kw)}
    try:
        from cltrain.integrations.transformers import ChannelsLastCallback
    except ImportError:
        return doors
    from cltrain.integrations.accelerate import prepare_channels_last

    doors["ChannelsLastCallback"] = lambda **kw: ChannelsLastCallback(**kw)
    doors["prepare_channels_last"] = lambda **kw: prepare_channels_last(None, None, **kw)
    return doors


@pytest.mark.parametrize("door", sorted(_front_doors()))
def test_each_front_door_says_a_bad_mode_and_a_bad_flag_alike(door):
    make = _front_doors()[door]
    with pytest.raises(ValueError, match=rf"^{door}\(mode='nhwc'\): expected one of \('full', 'conv'"):
        make(mode="nhwc")
    with pytest.raises(ValueError, match=rf"^{re.escape(door)}\(guard='yes'\): expected True or False\.$"):
        make(guard="yes")


def test_the_checks_name_the_call_the_argument_and_what_it_takes():
    check_mode("f", "full") or check_flags("f", a=True, b=False) or check_positive("f", "n", 3)
    check_positive("f", "n", None, optional=True) or check_positive("f", "t", 0.5, whole=False)
    for call, message in [(lambda: check_positive("f", "n", 0), "f(n=0): expected an int >= 1."),
                          (lambda: check_positive("f", "n", True), "f(n=True): expected an int >= 1."),
                          (lambda: check_positive("f", "n", 0, optional=True), "f(n=0): expected None or an int >= 1."),
                          (lambda: check_positive("f", "t", 0, whole=False), "f(t=0): expected seconds > 0."),
                          (lambda: check_mode("f", "fast", ("full", "conv", "off")),
                           "f(mode='fast'): expected one of ('full', 'conv', 'off')."),
                          (lambda: check_mode("f", "auto", ("full", "conv")),
                           "f(mode='auto'): the layout is chosen by layout= ('auto', the default, races both layouts on "
                           "the run's first training steps); mode takes ('full', 'conv')."),
                          (lambda: check_layout_choice("f", "nhwc"),
                           "f(layout='nhwc'): expected one of ('auto', 'channels_last', 'contiguous') ('auto', the "
                           "default, times both on the run's first training steps and keeps the faster).")]:
        with pytest.raises(ValueError) as raised:
            call()
        assert str(raised.value) == message


def test_the_loop_door_refuses_what_is_not_an_optimizer_before_it_touches_the_model():
    import torch

    from cltrain.loops import ChannelsLastRun, verify_layout

    model = torch.nn.Conv2d(3, 4, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    takes = "expected an optimizer or a list of them, as the loop steps it (torch.optim.AdamW(model.parameters()), " \
            "not its name or class)."
    for bad, shown in [("adam", "optimizer='adam'"), (torch.optim.AdamW, "optimizer=<class 'torch.optim.adamw.AdamW'>"),
                       ([sgd, "x"], "optimizer[1]='x'")]:
        with pytest.raises(ValueError) as raised:
            ChannelsLastRun(model, bad)
        assert str(raised.value) == f"ChannelsLastRun({shown}): {takes}"
    assert model.weight.is_contiguous()  # refused before the model was converted
    with pytest.raises(ValueError, match=r"^verify_layout\(optimizer=<list>\): expected an optimizer, "):
        verify_layout(model, torch.randn(2, 3, 8, 8), optimizer=[sgd])
    assert ChannelsLastRun(model, iter([sgd]), verify=False).optimizers == [sgd]


def test_the_doors_that_take_copies_take_a_module_a_list_or_a_function_and_refuse_the_rest():
    import torch

    from cltrain.loops import ChannelsLastRun
    from cltrain.options import check_copies

    ema = torch.optim.swa_utils.AveragedModel(torch.nn.Conv2d(3, 4, 3))
    assert check_copies("f", ema)() == [ema] and check_copies("f", [ema])() == [ema]
    assert check_copies("f", lambda: iter([ema]))() == [ema]
    doors = {"ChannelsLastRun": lambda **kw: ChannelsLastRun(torch.nn.Conv2d(3, 4, 3), verify=False, **kw)}
    doors.update({name: make for name, make in _front_doors().items() if name != "convert_model"})
    for name, make in doors.items():
        with pytest.raises(ValueError) as raised:
            make(copies=3)
        assert str(raised.value) == f"{name}(copies=3): expected the model's copies (a module, a list of them, or a " \
                                    "function giving them: copies=lambda: [ema])."


def test_an_ema_made_after_the_door_is_no_copy_until_it_exists():
    # As the guides say: the EMA made after the door converted the model, given as copies=lambda: [ema]. The door
    # converted [None] at its start: "to_channels_last expects a torch.Tensor or an nn.Module, got NoneType".
    import torch

    from cltrain.loops import ChannelsLastRun

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
    ema = None
    run = ChannelsLastRun(model, torch.optim.AdamW(model.parameters()), copies=lambda: [ema], layout="channels_last",
                          verify=False)
    ema = torch.optim.swa_utils.AveragedModel(model)
    assert run.session.host.copies() == [ema]
    assert ChannelsLastRun(torch.nn.Conv2d(3, 4, 3), verify=False, copies=None).session.host.copies() == []


def test_every_door_that_checks_refuses_a_bad_check_samples_alike():
    import torch

    from cltrain.loops import ChannelsLastRun

    doors = {"ChannelsLastRun": lambda **kw: ChannelsLastRun(torch.nn.Conv2d(3, 4, 3), verify=False, **kw)}
    doors.update({name: make for name, make in _front_doors().items() if name != "convert_model"})
    for name, make in doors.items():
        with pytest.raises(ValueError) as raised:
            make(check_samples=0)
        assert str(raised.value) == f"{name}(check_samples=0): expected None or an int >= 1.", name


def test_the_loop_door_refuses_a_dtype_a_device_or_a_function_it_cannot_use():
    import torch

    from cltrain.guardrails import apply_guardrails
    from cltrain.loops import ChannelsLastRun, verify_layout

    model = torch.nn.Conv3d(3, 4, 3)
    # dtype="bf16" was taken as float32: the bf16 guardrails (a Conv3d's weight gradient) were left out, unsaid
    for door, kwargs, line in [
        (ChannelsLastRun, {"dtype": "bf16"}, "ChannelsLastRun(dtype='bf16'): expected torch.bfloat16, torch.float16 "
                                             "or None (float32), the dtype the loop's autocast computes in."),
        (convert_model, {"dtype": torch.int8}, "convert_model(dtype=torch.int8): expected torch.bfloat16, "),
        (ChannelsLastRun, {"device": "gpu"}, "ChannelsLastRun(device='gpu'): expected a device torch knows "),
        (ChannelsLastRun, {"step": 3}, "ChannelsLastRun(step=3): expected None or a function step(model, batch)"),
        (ChannelsLastRun, {"log": 3}, "ChannelsLastRun(log=3): expected None or a function log(metrics)"),
        (verify_layout, {"batch": None, "samples": 0}, "verify_layout(samples=0): expected None or an int >= 1."),
        (verify_layout, {"batch": None, "report": "x"}, "verify_layout(report='x'): expected True or False."),
        (ChannelsLastRun, {"inputs": ""}, "ChannelsLastRun(inputs=''): expected None (the model's input), 'all', "),
        (apply_guardrails, {"dtype": "bf16"}, "apply_guardrails(dtype='bf16'): expected torch.bfloat16, "),
        (apply_guardrails, {"device": "gpu"}, "apply_guardrails(device='gpu'): expected a device torch knows "),
    ]:
        with pytest.raises(ValueError) as raised:
            door(model, **kwargs)
        assert str(raised.value).startswith(line) and "\n" not in str(raised.value)
    assert model.weight.is_contiguous()  # refused before the model was converted
    run = ChannelsLastRun(model, dtype=torch.bfloat16, device=torch.device("cpu"), verify=False, step=lambda m, b: 0)
    assert run.session.dtype is torch.bfloat16 and run.session.device == torch.device("cpu")
    run.end()


@pytest.mark.parametrize("package", ["cltrain", "cltrain.pl"])
def test_the_callback_pickles_with_its_copies(package):
    import importlib
    import pickle

    import torch

    door = importlib.import_module(package).ChannelsLast  # Lightning's ddp_spawn pickles the Trainer's callbacks
    ema = torch.nn.Conv2d(3, 4, 1)
    for callback, copies in ((door(), []), (door(copies=ema), [ema]), (door(copies=[ema, ema]), [ema, ema])):
        again = pickle.loads(pickle.dumps(callback))
        assert [c.weight.tolist() for c in again.copies()] == [c.weight.tolist() for c in copies]

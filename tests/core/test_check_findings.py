"""What a finding blames: a guarded layer is compared as one unit with its guard (a Hugging Face BiT model's
guarded shortcut passes), a finding at a guardrail names the guard, and code in an installed package is
named as the package's, with nothing for the user to edit (but a hook of the user's own on it)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cltrain.check.localise import place, user_frame
from cltrain.check.result import Finding
from cltrain.guardrails import KNOWN_FAULTS, apply_guardrails, guard_of
from cltrain.loops import convert_model, verify_layout

transformers = pytest.importorskip("transformers")


def _bit() -> torch.nn.Module:
    # BiT: weight-standardised convolutions (a Conv2d subclass with its own forward); each stage's shortcut is a
    # 1x1 stride-2 convolution, the first on 8 input channels, which oneDNN #6035's guardrail gives an NCHW input
    torch.manual_seed(0)
    config = transformers.BitConfig(embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=5,
                                    layer_type="preactivation", global_padding="SAME", num_groups=4)
    return transformers.BitForImageClassification(config)


def _check(model: torch.nn.Module) -> str:
    g = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(4, 3, 64, 64, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)}
    result = verify_layout(model, batch, lambda m, b: m(**b).loss,
                           optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), report=False)
    return result


def test_a_guarded_shortcut_is_compared_with_its_guard_and_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    model = convert_model(_bit())
    records = apply_guardrails(model, device="cpu")
    guarded = [n for n, m in model.named_modules() if guard_of(m) is not None]
    if not guarded:
        pytest.skip("the oneDNN #6035 guardrail does not apply on this platform")
    assert any("downsample.conv" in n for n in guarded) and records
    result = _check(model)
    assert result.verdict == "passed", result.line()
    # The negative control: recording the conv's input after the guard copied it (a hook registered last) sees
    # only the shortcut's share of the gradient, and blames the shortcut.
    original = torch.nn.Module.register_forward_pre_hook

    def appended(self, hook, *, prepend=False, with_kwargs=False):  # noqa: ANN001, ANN202
        return original(self, hook, prepend=False, with_kwargs=with_kwargs)

    monkeypatch.setattr(torch.nn.Module, "register_forward_pre_hook", appended)
    result = _check(model)
    assert result.verdict == "fallback" and "downsample" in result.line(), result.line()
    assert "oneDNN #6035" in result.line() and "nothing to edit" in result.line(), result.line()


def test_guard_of_names_each_guardrail_and_nothing_else() -> None:
    stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1, stride=2), torch.nn.Conv2d(8, 8, 3), torch.nn.Conv3d(3, 4, 3))
    apply_guardrails(convert_model(stem), device="cpu", dtype=torch.bfloat16)
    found = {name: fault.key if fault else None for name, fault in
             ((n, guard_of(m)) for n, m in stem.named_children())}
    keys = {f.key for f in KNOWN_FAULTS}
    assert found["1"] is None
    assert found["0"] in keys | {None} and found["2"] in keys | {None}  # platform-dependent: None where not x86
    if found["0"] is not None:
        assert found["0"] == "onednn-1x1-strided-few-channels" and found["2"] == "onednn-bf16-conv3d-weight-grad"


def test_a_finding_in_an_installed_package_or_at_a_guard_asks_nothing_of_the_user() -> None:
    module = transformers.models.bit.modeling_bit
    where, package = place(module.__file__, 812)
    assert package == "transformers" and where == "transformers/models/bit/modeling_bit.py:812", where
    in_package = Finding("raised", "forward", "model.vision", where, "RuntimeError: view size is not compatible",
                         package=package)
    assert "installed package `transformers`" in in_package.fix() and "fallback stands" in in_package.fix()
    mine = Finding("raised", "forward", "net", "/home/me/project/model.py:12", "RuntimeError: view size is not ...")
    assert mine.package is None and ".reshape" in mine.fix() and "inputs=" not in mine.fix()
    # the step code viewing a tensor of the batch: perhaps a target the batch rules took for the input
    step = Finding("raised", "step", None, "/home/me/project/train.py:40", "RuntimeError: view size is not compatible")
    assert ".reshape" in step.fix() and "name the input instead: inputs=<key or index>" in step.fix()
    guarded = Finding("diverged", "backward", "net.down", where, "1.4 relative difference", guard="oneDNN #6035")
    assert "oneDNN #6035" in guarded.fix() and "nothing to edit" in guarded.fix()


@pytest.mark.parametrize("folder", ["torch", "lightning", "cltrain", "site-packages"])
def test_the_users_code_is_found_by_where_packages_are_not_by_folder_names(tmp_path, folder: str) -> None:
    source = tmp_path / folder / "models" / "net.py"
    source.parent.mkdir(parents=True)
    source.write_text("import torch\n\n\nclass Net(torch.nn.Module):\n    def forward(self, x):\n"
                      "        return x.view(x.size(0), -1)\n")
    spec = importlib.util.spec_from_file_location(f"user_net_{folder.replace('-', '_')}", source)
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    with pytest.raises(RuntimeError) as caught:
        user.Net()(torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last))
    where, package = user_frame(caught.value)
    assert package is None and where.endswith(f"{folder}/models/net.py:6"), where


def test_a_tv_tensor_batchs_pass_through_is_not_the_users_code() -> None:
    # anomalib's batches are torchvision.tv_tensors.Image: a .view in the user's step was placed in torchvision's
    # __torch_function__ ("nothing to edit: that code is in the installed package `torchvision`")
    from torchvision import tv_tensors

    x = tv_tensors.Image(torch.randn(2, 3, 4, 4)).to(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError) as caught:
        x.view(x.size(0), -1)  # this line
    where, package = user_frame(caught.value)
    assert package is None and where.endswith(f"test_check_findings.py:{caught.traceback[0].lineno + 1}"), where


class _Flattens(torch.Tensor):
    """A user's own tensor subclass whose ``__torch_function__`` assumes NCHW."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.mean:
            t = args[0].as_subclass(torch.Tensor)
            return t.view(t.size(0), -1).mean()  # the user's NCHW assumption
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_users_own_torch_function_is_the_users_code() -> None:
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last).as_subclass(_Flattens)
    with pytest.raises(RuntimeError) as caught:
        x.mean()
    where, package = user_frame(caught.value)
    line = _Flattens.__torch_function__.__code__.co_firstlineno + 4
    assert package is None and where.endswith(f"test_check_findings.py:{line}"), where


def _reads_nchw(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    n, c, h, w = out.shape  # the user's hook reads the output's memory as NCHW
    return torch.as_strided(out, (n, c * h * w), (c * h * w, 1)).view(n, c, h, w)


def test_a_users_hook_on_a_packages_module_is_the_users_to_fix() -> None:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5)
    model.layer3.register_forward_hook(_reads_nchw)
    model = convert_model(model)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 5, (4,), generator=g))
    result = verify_layout(model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                           optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), report=False)
    line = _reads_nchw.__code__.co_firstlineno
    assert result.verdict in ("fallback", "contiguous"), result.line()
    finding = result.findings[0]
    assert finding.module == "layer3" and finding.where.endswith(f"test_check_findings.py:{line}"), finding
    assert finding.package is None and ".contiguous()" in result.line() and "nothing to edit" not in result.line()


def test_a_users_forward_set_on_a_packages_module_is_the_users_to_fix() -> None:
    # named `backward at torch/nn/modules/container.py` with "nothing to edit: that code is in the installed package"
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5)
    inner = model.layer3.forward
    model.layer3.forward = lambda x: _reads_nchw(None, (x,), inner(x))  # a notebook's patch of a torchvision block
    model = convert_model(model)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 5, (4,), generator=g))
    result = verify_layout(model, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                           optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), report=False)
    line = test_a_users_forward_set_on_a_packages_module_is_the_users_to_fix.__code__.co_firstlineno + 7
    assert result.verdict in ("fallback", "contiguous"), result.line()
    finding = result.findings[0]
    assert finding.module == "layer3" and finding.where.endswith(f"test_check_findings.py:{line}"), finding
    assert finding.package is None and "nothing to edit" not in result.line()


def test_a_long_note_never_takes_the_place_and_the_fix_out_of_the_line() -> None:
    # "`layer2` raised in channels_last only (forward at…": the note was kept whole, the finding cut to 40 characters
    from cltrain.check.fallback import Fallback
    from cltrain.check.result import MAX_LINE, LayoutCheck

    finding = Finding("raised", "forward", "layer2", "bad_code.py:26", "RuntimeError: view size is not compatible")
    note = "the model alone, on the batch's image tensor: " + "the step raised on the check's NCHW copy " * 4
    check = LayoutCheck("fallback", findings=(finding,), fallbacks=(Fallback("module", "layer2.1"),), notes=(note,))
    line = check.line()
    assert len(line) <= MAX_LINE and "(forward at bad_code.py:26); fix: use .reshape(...)" in line, line
    assert "-> `layer2.1` runs in NCHW; the model alone" in line and line.endswith("s)"), line
    short = LayoutCheck("fallback", findings=(finding,), fallbacks=(Fallback("module", "layer2.1"),), notes=("a note",))
    assert "NCHW; a note (0.0 s)" in short.line() and "[RuntimeError: view size" in short.line(), short.line()


def test_a_line_whose_findings_fill_it_keeps_the_start_of_a_note_saying_the_step_was_checked_in_part() -> None:
    from cltrain.check.fallback import Fallback
    from cltrain.check.result import MAX_LINE, LayoutCheck

    findings = tuple(Finding("raised", "forward", f"layer{k}", f"bad_code.py:{k}", "RuntimeError: view size")
                     for k in range(1, 4))
    note = "the model alone, on the batch's image tensor: the step raised on the check's NCHW copy (KeyError: 'x')"
    line = LayoutCheck("fallback", findings=findings, fallbacks=(Fallback("module", "layer1"),), notes=(note,)).line()
    assert len(line) <= MAX_LINE and "(forward at bad_code.py:1); fix: make that code layout-agnostic" in line, line
    assert "; the model alone, on the batch's image tensor" in line, line

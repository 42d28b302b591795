"""Layout audit: finds the ops that lose channels_last, with their module path, and changes nothing."""

import torch
from torch import nn

import cltrain
from cltrain import to_channels_last
from cltrain.audit import AuditReport, audit_model


class LosesLayout(nn.Module):
    """A planted layout-losing op: a forward that makes an NCHW copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous() * 2


class _NCHWGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class LosesLayoutInBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NCHWGrad.apply(x)


def clean_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )


def planted_model(planted: nn.Module) -> nn.Module:
    body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
    body.add_module("planted", planted)
    return nn.Sequential(nn.Conv2d(3, 3, 1), body, nn.Conv2d(8, 4, 3))


def x() -> torch.Tensor:
    return torch.randn(2, 3, 16, 16)


def test_finds_a_planted_layout_losing_op_and_its_module_path():
    model = to_channels_last(planted_model(LosesLayout()))
    report = audit_model(model, x())
    assert [(r.op, r.module_path, r.phase, r.kind, r.count) for r in report.rows] == [("aten.clone", "1.planted", "forward", "copy", 1)]
    row = report.rows[0]
    assert row.input_shapes == ((2, 8, 16, 16),) and row.input_strides == ((2048, 1, 128, 8),)
    assert row.output_shape == (2, 8, 16, 16) and row.output_stride == (2048, 256, 16, 1)
    # the NCHW copy, then the next conv converts back (forward and backward)
    assert report.layout_copies == 3
    assert [(r.op, r.kind, r.module_path) for r in report.copies] == [
        ("aten.clone", "copy", "1.planted"), ("aten.convolution", "implicit", "2"), ("aten.convolution_backward", "implicit", "2"),
    ]
    table = str(report)
    assert "1.planted" in table and "aten.clone" in table and "(2048,256,16,1)" in table and "lost the channels_last" in table


def test_attributes_backward_ops_to_the_module_that_made_them():
    model = to_channels_last(planted_model(LosesLayoutInBackward()))
    report = audit_model(model, x())
    assert [(r.op, r.module_path, r.phase) for r in report.rows] == [("aten.clone", "1.planted", "backward")]


def test_reports_none_on_a_model_with_none():
    report = audit_model(to_channels_last(clean_model()), x())
    assert isinstance(report, AuditReport)
    assert report.rows == [] and report.layout_copies == 0 and report.ops_seen > 20
    assert "No op lost the channels_last layout" in report.format_table()


def test_reports_none_under_bf16_autocast():
    report = audit_model(to_channels_last(clean_model()), x(), autocast_dtype=torch.bfloat16)
    assert report.rows == [] and report.layout_copies == 0
    assert "autocast bfloat16" in str(report)


def test_counts_implicit_copies_when_input_and_weights_disagree():
    report = audit_model(to_channels_last(clean_model()), x(), convert_input=False)
    assert report.rows == []
    # the first conv converts the NCHW input, in forward and again in backward
    assert report.layout_copies == 2
    assert [(r.op, r.kind, r.module_path) for r in report.copies] == [
        ("aten.convolution", "implicit", "0"), ("aten.convolution_backward", "implicit", "0"),
    ]


def test_permuting_a_whole_tensor_to_nhwc_is_not_a_loss():
    class ChannelsLastLayerNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    model = to_channels_last(nn.Sequential(nn.Conv2d(3, 8, 3), ChannelsLastLayerNorm(8), nn.Conv2d(8, 4, 3)))
    assert audit_model(model, x()).rows == []


def test_leaves_the_model_as_it_was():
    model = to_channels_last(clean_model())
    model(x()).sum().backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    audit_model(model, x())
    assert model.training
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # BN running stats too
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    model.eval()
    audit_model(model, x())
    assert not model.training
    assert all(h == {} for m in model.modules() for h in (m._forward_hooks, m._forward_pre_hooks))


def test_custom_loss_fn_and_tuple_input():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, a, b):
            return {"out": self.conv(a) + self.conv(b)}

    model = to_channels_last(TwoInputs())
    report = audit_model(model, (x(), x()), loss_fn=lambda out: out["out"].mean())
    assert report.rows == [] and report.input_shapes == ((2, 3, 16, 16), (2, 3, 16, 16))


def test_is_exported_as_cltrain_audit_model():
    assert cltrain.audit_model is audit_model


def test_handles_5d_models():
    model = to_channels_last(nn.Sequential(nn.Conv3d(2, 4, 3), nn.BatchNorm3d(4), nn.ReLU(), nn.Conv3d(4, 4, 1)))
    # a batch of 16: torch runs a 1x1x1 Conv3d on a batch under 16 with one thread in its own kernel, which returns
    # NCHW (the audit then rightly reports it); from 16, or with more threads, in oneDNN's, which keeps the layout
    report = audit_model(model, torch.randn(16, 2, 6, 6, 6))
    assert report.rows == [] and report.layout_copies == 0


def test_a_map_of_1x1_is_no_copy_in_either_layout():
    # (N, C, 1, 1) is the same memory in both layouts: a convolution on it with channels_last weights copies nothing
    # (resnet18 at 32 px ends in 1x1 maps; the audit counted 6 copies there)
    import torchvision

    torch.manual_seed(0)
    model = to_channels_last(torchvision.models.resnet18(num_classes=4))
    report = audit_model(model, torch.randn(2, 3, 32, 32))
    assert report.layout_copies == 0, report.format_table()

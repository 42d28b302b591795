"""Layout helpers on real tensors and real torchvision models."""

import pytest
import torch
import torchvision
from torch import nn

from cltrain import is_channels_last, is_channels_last_1d, layout_of, layout_summary, to_channels_last, to_channels_last_1d
from cltrain.layout import memory_format_for

CL, CL3 = torch.channels_last, torch.channels_last_3d


@pytest.mark.parametrize(
    "shape",
    [(4, 3, 8, 8), (4, 1, 8, 8), (4, 3, 1, 1), (1, 3, 8, 8), (1, 1, 8, 8), (4, 16, 1, 7)],
    ids=["NCHW", "grayscale-N1HW", "pooled-NC11", "batch1", "batch1-gray", "H1"],
)
def test_tensor_4d_gets_channels_last_strides(shape):
    x = torch.randn(shape)
    y = to_channels_last(x)
    assert is_channels_last(y)
    # the canonical strides are exactly those of a tensor created channels_last
    assert y.stride() == torch.empty(shape, memory_format=CL).stride()
    assert torch.equal(x, y)


def test_tensor_5d_gets_channels_last_3d():
    x = torch.randn(2, 1, 3, 4, 5)
    y = to_channels_last(x)
    assert y.stride() == torch.empty(x.shape, memory_format=CL3).stride()
    assert is_channels_last(y) and torch.equal(x, y)


def test_ambiguous_shapes_need_to_not_contiguous():
    # The pitfall this library exists for: contiguous() thinks N1HW is already channels_last.
    x = torch.randn(4, 1, 8, 8)
    assert x.contiguous(memory_format=CL).stride() == x.stride()
    assert not is_channels_last(x)
    assert is_channels_last(to_channels_last(x))


@pytest.mark.parametrize("shape", [(7,), (3, 4), (3, 8, 8), (2, 3, 4, 5, 6, 7)])
def test_other_ranks_returned_as_they_are(shape):
    x = torch.randn(shape)
    assert to_channels_last(x) is x
    assert not is_channels_last(x)
    assert memory_format_for(x) is None


def test_no_copy_when_already_channels_last():
    x = torch.randn(2, 3, 8, 8).to(memory_format=CL)
    assert to_channels_last(x) is x
    x5 = torch.randn(2, 3, 4, 8, 8).to(memory_format=CL3)
    assert to_channels_last(x5) is x5


def test_predicate_on_ambiguous_and_odd_shapes():
    # contiguous N1HW / NC11: torch's is_contiguous(channels_last) says True, we say False
    gray = torch.randn(2, 1, 5, 5)
    assert gray.is_contiguous(memory_format=CL) and not is_channels_last(gray)
    pooled = torch.randn(2, 8, 1, 1)
    assert pooled.is_contiguous(memory_format=CL) and not is_channels_last(pooled)
    # C == H == W == 1: both layouts have identical strides; documented answer is True
    ones = torch.randn(3, 1, 1, 1)
    assert is_channels_last(ones) and ones.is_contiguous()
    # a single HWC image made a batch with unsqueeze: batch stride is not compared when N == 1
    hwc = torch.zeros(6, 5, 3).permute(2, 0, 1).unsqueeze(0)
    assert hwc.stride()[0] != torch.empty(hwc.shape, memory_format=CL).stride()[0]
    assert is_channels_last(hwc)
    # a non-dense slice of a channels_last tensor is not dense channels_last
    sliced = torch.randn(2, 3, 8, 8).to(memory_format=CL)[:, :, ::2]
    assert not is_channels_last(sliced) and layout_of(sliced) == "strided"
    assert not is_channels_last(torch.randn(2, 3, 8, 8))


def test_layout_of_words():
    assert layout_of(torch.randn(2, 3, 4, 4)) == "contiguous"
    assert layout_of(torch.randn(2, 3, 4, 4, 4).to(memory_format=CL3)) == "channels_last_3d"
    assert layout_of(torch.randn(3)) == "rank1"


class Mixed(nn.Module):
    """Conv2d and Conv3d in one model, plus a 4-D parameter and a 4-D buffer that are not convs."""

    def __init__(self):
        super().__init__()
        self.conv2 = nn.Conv2d(3, 8, 3)
        self.deconv2 = nn.ConvTranspose2d(8, 4, 2)
        self.conv3 = nn.Conv3d(2, 4, 3)
        self.pos = nn.Parameter(torch.randn(1, 4, 6, 6))
        self.register_buffer("table", torch.randn(1, 3, 2, 2))
        self.fc = nn.Linear(4, 2)


def test_plain_module_to_fails_on_mixed_model_ours_does_not():
    with pytest.raises(RuntimeError):  # pytorch#77821: the reason mode="full" goes per rank
        Mixed().to(memory_format=CL)
    m = Mixed()
    weight = m.conv2.weight
    assert to_channels_last(m) is m
    assert m.conv2.weight is weight  # same Parameter object: optimizers and DDP keep working
    assert is_channels_last(m.conv2.weight) and is_channels_last(m.deconv2.weight)
    assert m.conv3.weight.is_contiguous(memory_format=CL3) and is_channels_last(m.conv3.weight)
    assert is_channels_last(m.pos) and is_channels_last(m.table)
    assert m.fc.weight.is_contiguous() and m.conv2.bias.is_contiguous()


def test_conv_mode_converts_only_conv_weights():
    m = to_channels_last(Mixed(), mode="conv")
    assert is_channels_last(m.conv2.weight) and is_channels_last(m.deconv2.weight) and is_channels_last(m.conv3.weight)
    assert layout_of(m.pos) == "contiguous" and layout_of(m.table) == "contiguous"
    # the same strides as PyTorch's own conv-weight converters
    ref = Mixed()
    torch.nn.utils.convert_conv2d_weight_memory_format(ref, CL)
    torch.nn.utils.convert_conv3d_weight_memory_format(ref, CL3)
    assert m.conv2.weight.stride() == ref.conv2.weight.stride()
    assert m.conv3.weight.stride() == ref.conv3.weight.stride()


def test_gradients_are_restrided_with_their_parameter():
    m = nn.Conv2d(3, 4, 3)
    m(torch.randn(2, 3, 6, 6)).sum().backward()
    assert m.weight.grad.is_contiguous()
    to_channels_last(m)
    assert m.weight.grad.stride() == m.weight.stride()


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="'fast'"):
        to_channels_last(nn.Conv2d(1, 1, 1), mode="fast")
    with pytest.raises(TypeError, match="list"):
        to_channels_last([torch.randn(1, 1, 1, 1)])


def test_summary_counts_by_layout():
    m = torchvision.models.resnet18(num_classes=10)
    before = layout_summary(m)
    assert before == {"contiguous": 20, "rank1": 41, "rank2": 1}
    to_channels_last(m)
    assert layout_summary(m) == {"channels_last": 20, "rank1": 41, "rank2": 1}
    # buffers: BN running stats (1-D) and num_batches_tracked (0-D)
    assert layout_summary(m, buffers=True)["rank0"] == 20


def test_lazy_modules_are_left_uninitialized():
    m = nn.Sequential(nn.LazyConv2d(4, 3))
    to_channels_last(m)
    assert layout_summary(m) == {"uninitialized": 2}
    m(torch.randn(1, 3, 5, 5))
    assert layout_summary(to_channels_last(m))["channels_last"] == 1


def test_converted_resnet_computes_the_same():
    torch.manual_seed(0)
    ref = torchvision.models.resnet18(num_classes=10).eval()
    cl = to_channels_last(torchvision.models.resnet18(num_classes=10).eval())
    cl.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(cl(to_channels_last(x)), ref(x), rtol=1e-4, atol=1e-4)
    assert is_channels_last(cl.conv1.weight)  # load_state_dict keeps the layout


# ---- channels-last 1-D -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "strides"),
    [((2, 4, 10), (40, 1, 4)), ((2, 1, 10), (10, 1, 1)), ((2, 4, 1), (4, 1, 4)), ((1, 4, 10), (40, 1, 4))],
)
def test_1d_tensor_gets_c_l_1_c_strides_values_unchanged(shape, strides):
    x = torch.randn(shape)
    y = to_channels_last_1d(x)
    assert y.stride() == strides and torch.equal(x, y) and is_channels_last_1d(y)
    assert to_channels_last_1d(y) is y  # no copy when already there
    assert layout_of(y) == "channels_last_1d" and layout_of(x) == "rank3"


def test_1d_predicate_on_ambiguous_shapes():
    # plain contiguous tensors whose size-1 dims make torch's own checks ambiguous are NCL here
    assert not is_channels_last_1d(torch.randn(2, 1, 10))  # C == 1: strides (10, 10, 1)
    assert not is_channels_last_1d(torch.randn(2, 4, 1))  # L == 1: strides (4, 1, 1)
    assert is_channels_last_1d(torch.randn(3, 1, 1))  # C == L == 1: the layouts coincide
    assert is_channels_last_1d(torch.randn(1, 10, 4).transpose(1, 2))  # an NLC buffer seen as NCL
    assert not is_channels_last_1d(torch.randn(2, 4, 10)[:, :, ::2])  # a strided slice
    assert not is_channels_last_1d(to_channels_last(torch.randn(2, 3, 4, 4)))  # other ranks
    assert to_channels_last_1d(torch.randn(2, 3, 4, 4)).stride() == (48, 16, 4, 1)


def test_1d_gradients_flow_and_conv1d_computes_the_same():
    conv = nn.Conv1d(4, 6, 3)
    x = torch.randn(2, 4, 16, requires_grad=True)
    expected = conv(x)
    expected.sum().backward()
    grad_x, grad_w = x.grad.clone(), conv.weight.grad.clone()
    x.grad = None
    to_channels_last_1d(conv)  # restrides the weight and its grad in place
    assert is_channels_last_1d(conv.weight) and is_channels_last_1d(conv.weight.grad)
    conv.weight.grad = None
    out = conv(to_channels_last_1d(x))
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    torch.testing.assert_close(x.grad, grad_x)
    torch.testing.assert_close(conv.weight.grad, grad_w)


def test_1d_module_helper_converts_only_conv1d_weights():
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ConvTranspose1d(4, 2, 3), nn.Conv2d(2, 2, 3), nn.Linear(3, 3))
    to_channels_last_1d(model)
    assert is_channels_last_1d(model[0].weight) and is_channels_last_1d(model[1].weight)
    assert model[2].weight.is_contiguous() and model[3].weight.is_contiguous()
    with pytest.raises(TypeError, match="got list"):
        to_channels_last_1d([1])


def test_full_and_conv_modes_leave_rank_3_alone():
    model = nn.Sequential(nn.Conv1d(2, 4, 3))
    for mode in ("full", "conv"):
        to_channels_last(model, mode=mode)
        assert model[0].weight.is_contiguous() and not is_channels_last_1d(model[0].weight)
    x = torch.randn(2, 4, 8)
    assert to_channels_last(x) is x

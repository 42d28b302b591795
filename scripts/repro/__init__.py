"""Upstream repros and small kernel checks, each in plain PyTorch.

``onednn_1x1_strided_conv``, ``cpu_bf16_conv3d_grad`` and ``cpu_bn_channels_last_accuracy`` import nothing
from this repository, so each file can be attached to an upstream report as it is.
"""

"""Channels-last convolution tasks of the template tests: `conv2d_channels_last` on NHWC data with
(O, kH, kW, C / groups) weights, and PyTorch's result for them in float64."""
import torch
import torch.nn.functional as F

import kiln
from kiln.plugins.registry import registry


def channels_last_task(tensors, kwargs):
    """The task of conv2d_channels_last on `tensors` (x, weight and, unless None, bias)."""
    definition = registry().operator("conv2d_channels_last")
    return definition.task(definition.bind([kiln.from_torch(t) for t in tensors if t is not None], kwargs))[0]


def random_task(x_shape, w_shape, dtype=torch.float16, bias=False, **kwargs):
    """The task of conv2d_channels_last on random tensors of these shapes (a bias if `bias`)."""
    x, w = torch.randn(x_shape).to(dtype), torch.randn(w_shape).to(dtype)
    return channels_last_task((x, w, torch.randn(w_shape[0]).to(dtype) if bias else None), kwargs)


def reference(x, w, b, kwargs):
    """conv2d_channels_last(x, w, b, **kwargs) by F.conv2d in float64 on permuted data."""
    out = F.conv2d(x.double().permute(0, 3, 1, 2), w.double().permute(0, 3, 1, 2), None if b is None else b.double(),
                   **kwargs)
    return out.permute(0, 2, 3, 1)

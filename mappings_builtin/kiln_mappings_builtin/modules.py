"""nn.Module rules, for graphs with call_module nodes (symbolic_trace, or dynamo without
inlining built-in modules): each reads its module's parameters once, as graph constants."""
from torch import nn

from kiln import ops
from kiln.frontend.torch import KilnModule, register_module

# module class -> (Kiln operator, the module attributes passed after the input, in order)
ELEMENTWISE = {
    nn.ReLU: ("relu", ()), nn.ReLU6: ("relu6", ()), nn.GELU: ("gelu", ("approximate",)),
    nn.SiLU: ("silu", ()), nn.Sigmoid: ("sigmoid", ()), nn.Tanh: ("tanh", ()),
    nn.Hardtanh: ("hardtanh", ("min_val", "max_val")), nn.Hardsigmoid: ("hardsigmoid", ()),
    nn.Hardswish: ("hardswish", ()), nn.LeakyReLU: ("leaky_relu", ("negative_slope",)),
    nn.ELU: ("elu", ("alpha",)), nn.SELU: ("selu", ()), nn.CELU: ("celu", ("alpha",)),
    nn.Softplus: ("softplus", ("beta", "threshold")), nn.Mish: ("mish", ()),
    nn.LogSigmoid: ("logsigmoid", ()), nn.Softsign: ("softsign", ()),
    nn.Softmax: ("softmax", ("dim",)), nn.LogSoftmax: ("log_softmax", ("dim",)),
    nn.Flatten: ("flatten", ("start_dim", "end_dim")),
    nn.MaxPool1d: ("max_pool1d", ("kernel_size", "stride", "padding", "dilation", "ceil_mode")),
    nn.MaxPool2d: ("max_pool2d", ("kernel_size", "stride", "padding", "dilation", "ceil_mode")),
    nn.AvgPool1d: ("avg_pool1d", ("kernel_size", "stride", "padding", "ceil_mode",
                                  "count_include_pad")),
    nn.AvgPool2d: ("avg_pool2d", ("kernel_size", "stride", "padding", "ceil_mode",
                                  "count_include_pad", "divisor_override")),
    nn.AdaptiveAvgPool1d: ("adaptive_avg_pool1d", ("output_size",)),
    nn.AdaptiveAvgPool2d: ("adaptive_avg_pool2d", ("output_size",)),
    nn.AdaptiveMaxPool1d: ("adaptive_max_pool1d", ("output_size",)),
    nn.AdaptiveMaxPool2d: ("adaptive_max_pool2d", ("output_size",)),
    nn.MaxPool3d: ("max_pool3d", ("kernel_size", "stride", "padding", "dilation", "ceil_mode")),
    nn.AvgPool3d: ("avg_pool3d", ("kernel_size", "stride", "padding", "ceil_mode",
                                  "count_include_pad", "divisor_override")),
    nn.AdaptiveAvgPool3d: ("adaptive_avg_pool3d", ("output_size",)),
    nn.AdaptiveMaxPool3d: ("adaptive_max_pool3d", ("output_size",)),
    nn.Upsample: ("interpolate", ("size", "scale_factor", "mode", "align_corners")),
}


class Elementwise(KilnModule):
    """A module that is one Kiln operator of its input and some of its attributes."""

    op, attributes = "", ()

    def __call__(self, x):
        return getattr(ops, self.op)(x, *(getattr(self.torch_module, a) for a in self.attributes))


def _no_indices(module, *args) -> bool:
    return not getattr(module, "return_indices", False)


for _cls, (_op, _attrs) in ELEMENTWISE.items():
    register_module(_cls, check=_no_indices)(
        type(f"Kiln{_cls.__name__}", (Elementwise,), {"op": _op, "attributes": _attrs}))


@register_module(nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout,
                 check=lambda module, *args: not module.training or module.p == 0
                 if hasattr(module, "p") else True)
class Identity(KilnModule):
    def __call__(self, x, *args, **kwargs):
        return x


@register_module(nn.Linear)
class Linear(KilnModule):
    def __call__(self, x):
        return ops.linear(x, self.param("weight"), self.param("bias", optional=True))


class Convolution(KilnModule):
    """Conv1d, Conv2d and Conv3d with zero padding."""

    def __call__(self, x):
        m = self.torch_module
        return getattr(ops, f"conv{len(m.kernel_size)}d")(
            x, self.param("weight"), self.param("bias", optional=True), m.stride, m.padding,
            m.dilation, m.groups)


register_module(nn.Conv1d, nn.Conv2d, nn.Conv3d, check=lambda m, *a: m.padding_mode == "zeros"
                and not isinstance(m.padding, str))(Convolution)


@register_module(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
class ConvTranspose(KilnModule):
    def __call__(self, x):
        m = self.torch_module
        return getattr(ops, f"conv_transpose{len(m.kernel_size)}d")(x, self.param("weight"), self.param("bias", optional=True),
                                    m.stride, m.padding, m.output_padding, m.groups, m.dilation)


@register_module(nn.BatchNorm1d, nn.BatchNorm2d, check=lambda m, *a: not m.training
                 and m.track_running_stats)
class BatchNorm(KilnModule):
    def __call__(self, x):
        return ops.batch_norm(x, self.param("running_mean"), self.param("running_var"),
                              self.param("weight", optional=True), self.param("bias", optional=True),
                              self.torch_module.eps)


@register_module(nn.LayerNorm)
class LayerNorm(KilnModule):
    def __call__(self, x):
        m = self.torch_module
        return ops.layer_norm(x, tuple(m.normalized_shape), self.param("weight", optional=True),
                              self.param("bias", optional=True), m.eps)


@register_module(nn.GroupNorm)
class GroupNorm(KilnModule):
    def __call__(self, x):
        m = self.torch_module
        return ops.group_norm(x, m.num_groups, self.param("weight", optional=True),
                              self.param("bias", optional=True), m.eps)


@register_module(nn.RMSNorm)
class RMSNorm(KilnModule):
    def __call__(self, x):
        m = self.torch_module
        return ops.rms_norm(x, tuple(m.normalized_shape), self.param("weight", optional=True), m.eps)


@register_module(nn.Embedding, check=lambda m, *a: m.max_norm is None)
class Embedding(KilnModule):
    def __call__(self, x):
        return ops.embedding(x, self.param("weight"))

"""Activation functions, as torch.nn.functional defines them.

Each is an element-wise compute (`elementwise_compute`): 16-bit floats compute in float32 and
round once. Most take floating-point inputs only, as in PyTorch; relu, hardtanh and relu6 also
keep integer types, and softsign takes integers to float32.
"""
import math

from kiln import ir
from kiln.graph import OperatorError, operator
from kiln.ir import cast, select

from kiln_ops_builtin.common import FLOATING, NUMERIC, elementwise_compute, logistic

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _activation(name: str, input, fn, accepts=FLOATING, to_float: bool = False):
    return elementwise_compute(name, (input,), fn, accepts, to_float)


def _clamped(name: str, input, low, high):
    """`input` limited to [low, high], the bounds taking its type."""
    return _activation(name, input, lambda v: ir.minimum(ir.maximum(v, cast(low, v.dtype)),
                                                         cast(high, v.dtype)), NUMERIC)


def _elu(name: str, input, alpha: float, scale: float = 1.0, input_scale: float = 1.0):
    """scale * (x if x > 0 else alpha * (exp(x * input_scale) - 1))."""
    return _activation(name, input, lambda v: select(
        v > 0, v * scale, ir.expm1(v * input_scale) * (alpha * scale)))


@operator("relu")
def relu(input):
    """max(x, 0), keeping integer types."""
    return _activation("relu", input, lambda v: ir.maximum(v, 0), NUMERIC)


@operator("gelu")
def gelu(input, approximate: str = "none"):
    """x * Phi(x) with Phi the standard normal CDF: exact ('none', by erf) or 'tanh'."""
    if approximate == "none":
        return _activation("gelu", input, lambda v: 0.5 * v * (1 + ir.erf(v * math.sqrt(0.5))))
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        return _activation("gelu", input,
                           lambda v: 0.5 * v * (1 + ir.tanh(k * (v + 0.044715 * v * v * v))))
    raise OperatorError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


@operator("silu")
def silu(input):
    """x * sigmoid(x)."""
    return _activation("silu", input, lambda v: logistic(v, input.dtype, scale=v))


@operator("hardtanh")
def hardtanh(input, min_val: float = -1.0, max_val: float = 1.0):
    """x limited to [min_val, max_val]."""
    return _clamped("hardtanh", input, min_val, max_val)


@operator("relu6")
def relu6(input):
    """x limited to [0, 6]."""
    return _clamped("relu6", input, 0, 6)


@operator("hardsigmoid")
def hardsigmoid(input):
    """min(max(x + 3, 0), 6) / 6."""
    return _activation("hardsigmoid", input, lambda v: ir.minimum(ir.maximum(v + 3, 0), 6) / 6)


@operator("hardswish")
def hardswish(input):
    """x * min(max(x + 3, 0), 6) / 6."""
    return _activation("hardswish", input, lambda v: v * ir.minimum(ir.maximum(v + 3, 0), 6) / 6)


@operator("leaky_relu")
def leaky_relu(input, negative_slope: float = 0.01):
    """x if x > 0 else negative_slope * x."""
    return _activation("leaky_relu", input, lambda v: select(v > 0, v, v * negative_slope))


@operator("elu")
def elu(input, alpha: float = 1.0):
    """x if x > 0 else alpha * (exp(x) - 1)."""
    return _elu("elu", input, alpha)


@operator("selu")
def selu(input):
    """scale * elu(x, alpha) with the self-normalizing constants."""
    return _elu("selu", input, _SELU_ALPHA, _SELU_SCALE)


@operator("celu")
def celu(input, alpha: float = 1.0):
    """x if x > 0 else alpha * (exp(x / alpha) - 1)."""
    if alpha == 0:
        raise OperatorError("celu: alpha must not be 0")
    return _elu("celu", input, alpha, input_scale=1 / alpha)


@operator("softplus")
def softplus(input, beta: float = 1.0, threshold: float = 20.0):
    """log(1 + exp(beta * x)) / beta, or x where beta * x > threshold."""
    return _activation("softplus", input,
                       lambda v: select(v * beta > threshold, v, ir.log1p(ir.exp(v * beta)) / beta))


@operator("mish")
def mish(input):
    """x * tanh(softplus(x))."""
    return _activation("mish", input, lambda v: v * ir.tanh(ir.log1p(ir.exp(v))))


@operator("logsigmoid")
def logsigmoid(input):
    """log(sigmoid(x)), computed stably as min(x, 0) - log1p(exp(-|x|))."""
    return _activation("logsigmoid", input,
                       lambda v: ir.minimum(v, 0) - ir.log1p(ir.exp(-ir.abs_(v))))


@operator("softsign")
def softsign(input):
    """x / (1 + |x|) (integers give float32)."""
    return _activation("softsign", input, lambda v: v / (1 + ir.abs_(v)), NUMERIC, to_float=True)

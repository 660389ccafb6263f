"""Element-wise operators with PyTorch's broadcasting and type promotion."""
from kiln.ir import compute, maximum

from kiln_ops_builtin.common import binary_compute
from kiln.graph import operator


@operator("add")
def add(x, y):
    return binary_compute("add", x, y, lambda a, b: a + b)


@operator("relu")
def relu(x):
    return compute(x.shape, lambda *i: maximum(x[i], 0))

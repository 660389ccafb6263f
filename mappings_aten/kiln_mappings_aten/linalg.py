"""ATen matrix products: mm, bmm, addmm and the batched forms, onto Kiln's matmul; the grouped
matmul of mixture-of-experts layers (`aten._grouped_mm`, the torch-level rule's)."""
from kiln import ops
from kiln.frontend.torch import register_function
from kiln_mappings_builtin import products

from kiln_mappings_aten.common import aten


@register_function(aten._grouped_mm.default, check=products.row_groups)
def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    return products.grouped_mm(mat_a, mat_b, offs)


@register_function(aten.mm.default, aten.bmm.default, aten.matmul.default)
def mm(a, b):
    return ops.matmul(a, b)


def _scaled(x, factor):
    return x if factor == 1 else ops.mul(x, factor)


@register_function(aten.addmm.default, aten.baddbmm.default)
def addmm(bias, a, b, beta=1, alpha=1):
    """beta * bias + alpha * (a @ b)."""
    product = _scaled(ops.matmul(a, b), alpha)
    return product if beta == 0 else ops.add(_scaled(bias, beta), product)

"""An embedding's gradient in training graphs: `aten.embedding_dense_backward` onto Kiln's
`embedding_backward`, which makes the [num_weights, D] gradient in its own dtype directly.

torch's decomposition converts the token gradients to float32, scatters them with
`index_put(accumulate=True)` into zeros of the table's size in float32 and casts the sum to the
weight's dtype: for a bfloat16 table a float32 copy of it (262 MB for Llama's 32000 x 2048) is
an intermediate of the backward, and sets the size of its workspace. `kiln::embedding_backward`,
a torch operator that AOTAutograd keeps whole, carries the call to Kiln's operator instead,
which sums each row in float32 and rounds it once, as torch's does (on CUDA in scratch of the
tokens' size, `kiln_ops_builtin.templates.embedding_grad`).

Kiln's decomposition takes every call but those with `scale_grad_by_freq`, which keep torch's
decomposition (a count of each index's tokens, then the same scatter in float32). Outside Kiln's
traces (a partition handed to PyTorch) the operator runs PyTorch's own kernel.
"""
from __future__ import annotations

import torch
from torch._decomp import decomposition_table

from kiln import ops
from kiln.frontend.torch import register_decomposition, register_function

from kiln_mappings_aten.common import aten


@torch.library.custom_op("kiln::embedding_backward", mutates_args=())
def embedding_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int
                       ) -> torch.Tensor:
    """The gradient of a table of `num_weights` rows from token gradients `grad` [T, D] and
    their rows `indices` [T] (aten.embedding_dense_backward without scale_grad_by_freq)."""
    return aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, False)


@embedding_backward.register_fake
def _(grad, indices, num_weights, padding_idx):
    return grad.new_empty((num_weights, grad.shape[-1]))


@register_decomposition(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    """Kiln's embedding_backward on the tokens flattened; with scale_grad_by_freq (or a grad
    that is not floating-point), torch's decomposition."""
    if scale_grad_by_freq or not grad_output.dtype.is_floating_point or indices.dim() + 1 != grad_output.dim():
        return decomposition_table[aten.embedding_dense_backward.default](
            grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
    width = grad_output.shape[-1]
    return embedding_backward(grad_output.reshape(-1, width), indices.reshape(-1), num_weights, padding_idx)


@register_function(torch.ops.kiln.embedding_backward.default)
def embedding_backward_rule(grad, indices, num_weights, padding_idx):
    return ops.embedding_backward(grad, indices, num_weights, padding_idx)

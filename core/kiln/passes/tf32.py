"""TF32 permission: float32 products on CUDA may run on TF32 tensor cores.

An operator whose definition declares the trait `tf32` (`kiln.graph.Traits`) names the
permission it runs under (`kiln.graph.TF32`): matrix products the setting `allow_tf32`, which
the torch backend copies from `torch.backends.cuda.matmul.allow_tf32` (which
`torch.set_float32_matmul_precision("high")` also sets), convolutions the setting
`allow_tf32_convolution`, copied from `torch.backends.cudnn.allow_tf32`. Where its permission
is set, every such operator of float32 inputs on a CUDA device is made again with its
`allow_tf32` attribute set, which a template may read (gemm_sm90 and conv_sm90 do). The graph's
values are those of the definition; only how a GPU rounds the operands may change, as
PyTorch's own products do under the same flags.

Tensor cores read float32 operands by dropping their low 13 bits, which makes every product
smaller (by about 2^-11 per operand on average); cuBLAS and cuDNN round to nearest instead. So
the factors of a convolution (its first two tensor arguments) that are constants (weights,
folded batch norms) are replaced by copies rounded to TF32 to nearest (`rounded_to_tf32`),
which layout planning then turns into the channels-last weights the GPU reads (a copy it makes
anyway); a template rounds the factors it reads at run time (conv_sm90 does as it gathers x).
A matrix product's constant weights are left as they are: a rounded copy would hold a second
copy of every weight a model multiplies by (its x is truncated too, gemm_sm90 reading it by TMA).

`permissions(graph)` names the settings that decide some operator of a graph: a compiled graph
depends on those, and on no other of them.
"""
import torch

from kiln import dtypes
from kiln.graph import TF32
from kiln.passes.edit import rebuild, remake
from kiln.passes.graph_pass import GraphPass
from kiln.tensor import from_torch

FACTORS = 2
"""A product's factors are its first two tensor arguments (x and the weight, or x and y)."""


def permission(node) -> TF32 | None:
    """The permission deciding whether `node` may run on TF32: its operator's trait `tf32`
    where its inputs are float32 on a CUDA device, else None."""
    tf32 = node.definition.traits.tf32
    if tf32 is None or node.device.kind != "cuda" or any(t.dtype != dtypes.float32 for t in node.inputs):
        return None
    return tf32


def permissions(graph) -> frozenset[str]:
    """The settings (`TF32` values) deciding whether some node of `graph` runs on TF32."""
    return frozenset(p.value for p in map(permission, graph.nodes) if p is not None)


def rounded_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """Float32 `t` rounded to TF32 (10 mantissa bits) to nearest, ties away from zero, as the
    GPU's `cvt.rna.tf32.f32`: its low 13 bits cleared; NaNs are kept, overflow gives infinity."""
    bits = t.contiguous().view(torch.int32)
    rounded = ((bits + 0x1000) & -0x2000).view(torch.float32)
    return torch.where(t.isnan(), t, rounded)


def _round_constant_factors(inputs):
    return [from_torch(rounded_to_tf32(t.torch())) if k < FACTORS and not t.is_symbolic else t
            for k, t in enumerate(inputs)]


class AllowTF32(GraphPass):
    """Mark float32 operators of the trait `tf32` on CUDA `allow_tf32` where the setting their
    permission names allows TF32, a convolution's constant factors rounded to TF32."""

    name = "allow_tf32"
    opt_level = 0

    def transform(self, graph, ctx):
        settings = ctx.session.settings
        allowed = {p for p in TF32 if getattr(settings, p.value)}
        if not allowed:
            return graph

        def allow(node, inputs):
            granted = permission(node)
            if granted not in allowed or node.attrs.get("allow_tf32"):
                return None
            if granted is TF32.CONVOLUTION:
                inputs = _round_constant_factors(inputs)
            return remake(node, inputs, allow_tf32=True)

        return rebuild(graph, allow)

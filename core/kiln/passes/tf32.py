"""TF32 permission: float32 matrix products on CUDA may run on TF32 tensor cores.

When the context's config sets `allow_tf32` (the backend copies torch's
`torch.backends.cuda.matmul.allow_tf32` at compile time, which `torch.set_float32_matmul_
precision("high")` also sets), every operator of float32 inputs on a CUDA device whose
definition declares the trait `tf32` (`kiln.graph.Traits`) is made again with its `allow_tf32`
attribute set, which a template may read (gemm_sm90 does). The graph's values are those of
the definition; only how a GPU rounds the operands may change, as PyTorch's own matrix products
do under the same flag.
"""
from kiln import dtypes
from kiln.passes.edit import rebuild, remake
from kiln.passes.graph_pass import GraphPass


def _allowed(node, inputs):
    if (not node.definition.traits.tf32 or node.device.kind != "cuda" or node.attrs.get("allow_tf32")
            or any(t.dtype != dtypes.float32 for t in node.inputs)):
        return None
    return remake(node, inputs, allow_tf32=True)


class AllowTF32(GraphPass):
    """Mark float32 operators of the trait `tf32` on CUDA `allow_tf32` when the config allows
    TF32."""

    name = "allow_tf32"
    opt_level = 0

    def transform(self, graph, ctx):
        return rebuild(graph, _allowed) if ctx.session.settings.allow_tf32 else graph

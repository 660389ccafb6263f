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

`permissions(graph)` names the settings that decide some operator of a graph: a compiled graph
depends on those, and on no other of them.
"""
from kiln import dtypes
from kiln.graph import TF32
from kiln.passes.edit import rebuild, remake
from kiln.passes.graph_pass import GraphPass


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


class AllowTF32(GraphPass):
    """Mark float32 operators of the trait `tf32` on CUDA `allow_tf32` where the setting their
    permission names allows TF32."""

    name = "allow_tf32"
    opt_level = 0

    def transform(self, graph, ctx):
        settings = ctx.session.settings
        allowed = {p for p in TF32 if getattr(settings, p.value)}
        if not allowed:
            return graph

        def allow(node, inputs):
            if permission(node) not in allowed or node.attrs.get("allow_tf32"):
                return None
            return remake(node, inputs, allow_tf32=True)

        return rebuild(graph, allow)

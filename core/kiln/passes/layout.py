"""Layout planning: convolution-heavy regions run channels-last (NHWC).

What the pass knows of an operator it reads from the operator's traits (`kiln.graph.Traits`).
A convolution (an operator declaring its channels-last form, trait `channels_last`) that
`runs_channels_last` becomes that form on (N, H, W, C) data with (O, kH, kW, C / groups)
weights and a symmetric int padding ('same' and 'valid' resolved).
Where an ungrouped convolution's channels are not a multiple of 8 (a first layer's 3), its
input and weight are padded with zero channels up to one, so that a template reads 16-byte
vectors. The layout then travels forward with the data:

- element-wise and broadcasting operators (bias, activations, residual adds: see
  `is_elementwise`) take their 4-D operands channels-last; a broadcast operand, such as a
  (1, C, 1, 1) or (C, 1, 1) constant, is permuted too;
- pooling and batch norm (`Layout.OWN_DEFINITION`) run through `in_channels_last` (their own
  definitions reading and writing channels-last memory); sums, means and extremes
  (`Layout.REDUCE_DIMS`) reduce over the permuted dims;
- a pad (`Role.PAD`) pads the permuted dims; concatenations, splits, slices and softmaxes
  (`Layout.ALONG_DIM`) work along the permuted dim (channels: the last);
- a permute (an operator declaring its `permutation`) of channels-last data composes with the
  conversion (a model's own permute to NHWC costs nothing), and a model's permute back to NCHW
  (ConvNeXt's, after its layer norm and MLP over the channels) gives channels-last data again:
  the data it permutes.

Every other operator, and every graph output, reads NCHW: where one needs a channels-last
tensor, one conversion is made for all its readers, and converting a converted tensor back
gives the original. So conversions sit at the borders of regions only, constants (weights,
broadcast operands) are converted here, once, and the graph's inputs and outputs keep their
layout; the operators implementing `Role.PERMUTE` and `Role.RESHAPE` make the conversions.
The setting "channels_last" (`kiln.settings.Settings`) chooses which convolutions start a region (see
`runs_channels_last`; "never" turns the pass off). Under "auto" a graph is planned only where
every convolution in it runs channels-last: a graph that mixes in NCHW convolutions (grouped
ones no channels-last template takes, say) would convert back and forth around each of them.
"""
from __future__ import annotations

import torch

from kiln import dtypes
from kiln.graph import Layout, Operator, OperatorDef, Role, trace_from
from kiln.ir import Const, Load, Var, inline_task
from kiln.passes.channels_last import NCHW_TO_NHWC, NHWC_TO_NCHW, in_channels_last, permuted_shape
from kiln.passes.edit import arguments_of, producer, reapply
from kiln.passes.graph_pass import GraphPass
from kiln.passes.provided import implementer, provided
from kiln.schedule.session import CompileSession
from kiln.tensor import Tensor, from_torch, symbol

CHANNEL_MULTIPLE = 8      # channels of a channels-last convolution's input, padded with zeros to a multiple
ROLES_USED = (Role.PERMUTE, Role.RESHAPE, Role.PAD)


def int_pair(value) -> tuple[int, int]:
    """A convolution's int-or-pair argument (stride, padding, dilation) as a pair."""
    if isinstance(value, int):
        return value, value
    value = tuple(value)
    return value * 2 if len(value) == 1 else value


def conv_padding(node: Operator) -> tuple[int, int] | None:
    """Convolution `node`'s padding as (rows, columns) added on each side, or None where it pads
    one side more than the other ('same' with an odd kernel span)."""
    padding = node.attrs["padding"]
    if padding == "valid":
        return 0, 0
    if padding == "same":
        spans = [d * (k - 1) for d, k in zip(int_pair(node.attrs["dilation"]), node.inputs[1].shape[2:])]
        return None if any(s % 2 for s in spans) else (spans[0] // 2, spans[1] // 2)
    return int_pair(padding)


def padded_channels(channels: int, groups: int = 1) -> int:
    """The channels a channels-last convolution's input gets: a multiple of CHANNEL_MULTIPLE
    where the convolution is not grouped (its weight then has as many), else its own."""
    return channels if groups != 1 else -(-channels // CHANNEL_MULTIPLE) * CHANNEL_MULTIPLE


def appended_zero_channels(node: Operator) -> int:
    """How many zero channels `node` appends to 4-D data, where it is a pad (`Role.PAD`) doing
    only that (as this pass pads a convolution's input); else 0."""
    if node.definition.traits.implements is not Role.PAD or node.inputs[0].ndim != 4:
        return 0
    args = arguments_of(node)
    pad = list(args["pad"])
    if args["mode"] != "constant" or args["value"] != 0 or len(pad) != 2 or pad[0] != 0:
        return 0
    return max(pad[1], 0)


def permutation(node: Operator) -> list[int] | None:
    """The permutation (output dim k is input dim order[k]) `node` applies, where its operator
    declares one (trait `permutation`: permutes, transposes); else None."""
    order = node.definition.traits.permutation
    return None if order is None else order(node)


def runs_channels_last(node: Operator, mode: str, session: CompileSession) -> bool:
    """Whether convolution `node` runs channels-last under `mode` (the setting
    "channels_last"), asking `session` which templates take its channels-last form:

    - "auto": convolutions on CUDA in float16 or bfloat16, or in float32 marked `allow_tf32`
      (`kiln.passes.tf32`: they may run on TF32 tensor cores), that a schedule template on the
      device takes in their channels-last form (without such a template the NCHW templates are
      faster): the implicit GEMMs take ungrouped ones, conv_depthwise_nhwc depthwise and
      small-group ones; other float32 convolutions keep NCHW;
    - "always": every convolution its channels-last form can compute, on any device and in any
      type (what the CPU tests run);
    - "never": none.

    In every mode the operator must declare its channels-last form (trait `channels_last`), a
    plugin must provide that form, the input must be 4-D and the padding the same on both
    sides."""
    form = node.definition.traits.channels_last
    if (mode == "never" or form is None or provided(form) is None or node.inputs[0].ndim != 4
            or conv_padding(node) is None):
        return False
    if mode == "always":
        return True
    dtype = node.inputs[0].dtype
    return (node.device.kind == "cuda" and (dtype.is_16bit_float or dtype == dtypes.float32 and _tf32(node))
            and _template_takes(node, session))


def _tf32(node: Operator) -> dict:
    """The TF32 permission `node` carries to its channels-last form: {"allow_tf32": True} where
    the `allow_tf32` pass marked it, else nothing."""
    return {"allow_tf32": True} if node.attrs.get("allow_tf32") else {}


def _template_takes(node: Operator, session: CompileSession) -> bool:
    """Whether a schedule template for `node`'s device takes its channels-last form's task."""
    args = arguments_of(node)
    x, w, bias = args["x"], args["weight"], args["bias"]
    n, c, h, wd = x.shape
    channels = padded_channels(c, args["groups"])

    def placeholder(shape):
        return symbol(shape, x.dtype, node.device)

    task, _, _ = provided(node.definition.traits.channels_last).task({
        "x": placeholder((n, h, wd, channels)),
        "weight": placeholder((w.shape[0], *w.shape[2:], channels // args["groups"])),
        "bias": None if bias is None else placeholder(bias.shape),
        "stride": args["stride"], "padding": conv_padding(node), "dilation": args["dilation"],
        "groups": args["groups"], **_tf32(node)})
    return bool(session.templates(task, node.device))


def is_elementwise(node: Operator) -> bool:
    """Whether `node` computes each element of its one output from its inputs' elements at the
    same index, broadcast as torch broadcasts (missing leading dims, a size-1 dim read at 0),
    and from nothing else: then it computes the same on operands permuted alike."""
    if len(node.outputs) != 1 or not node.inputs or not node.task.is_injective:
        return False
    try:
        shape = tuple(torch.broadcast_shapes(*(t.shape for t in node.inputs)))
    except RuntimeError:
        return False
    if shape != node.outputs[0].shape:
        return False
    (out,) = inline_task(node.task).outputs
    seen, todo = set(), [out.value]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, Var):
            return False                      # an index used as a value (tril, arange-like)
        if isinstance(e, Load):
            if not _reads_in_place(e, out.axes):
                return False
            continue
        todo.extend(e.children())
    return True


def _reads_in_place(load: Load, axes) -> bool:
    offset = len(axes) - load.tensor.ndim
    return offset >= 0 and all(
        index is axes[offset + d] or (isinstance(index, Const) and index.value == 0 and size == 1)
        for d, (index, size) in enumerate(zip(load.indices, load.tensor.shape)))


class _Planner:
    """The rewritten graph's tensors for the original graph's, each in its planned layout."""

    def __init__(self, convolutions: set[int]):
        self.convolutions = convolutions                    # convolutions (by id) to run channels-last
        self.new: dict[int, Tensor] = {}                    # original tensor (by id) -> its new value
        self.nhwc_ids: set[int] = set()                     # original tensors whose new value is NHWC
        self.made: dict[tuple, tuple[Tensor, Tensor]] = {}  # (id(value), what) -> (value, result)

    def value(self, t: Tensor) -> Tensor:
        return self.new.get(id(t), t)

    def is_nhwc(self, t: Tensor) -> bool:
        return id(t) in self.nhwc_ids

    def nchw(self, t: Tensor) -> Tensor:
        """Original tensor `t` in its own layout."""
        return self.convert(self.value(t), NHWC_TO_NCHW) if self.is_nhwc(t) else self.value(t)

    def nhwc(self, t: Tensor) -> Tensor:
        """Original 4-D tensor `t` channels-last."""
        return self.value(t) if self.is_nhwc(t) else self.convert(self.value(t), NCHW_TO_NHWC)

    def _once(self, value: Tensor, what, make) -> Tensor:
        key = (id(value), what)
        if key not in self.made:
            self.made[key] = (value, make(value))
        return self.made[key][1]

    def convert(self, value: Tensor, order: tuple) -> Tensor:
        """`value` permuted by `order` (a layout conversion), made once (`permuted` makes
        converting a conversion back give the original)."""
        return self._once(value, order, lambda v: permuted(v, order))

    def broadcast_nhwc(self, t: Tensor) -> Tensor:
        """An operand of fewer than 4 dims broadcast against NCHW data, made 4-D and
        channels-last, so that it broadcasts the same against NHWC data."""
        value = self.nchw(t)
        if value.ndim == 0:
            return value
        full = self._once(value, "4-D", lambda v: reshaped(v, (1,) * (4 - v.ndim) + v.shape))
        return self.convert(full, NCHW_TO_NHWC)

    def channels_padded(self, value: Tensor, channels: int) -> Tensor:
        """Channels-last `value` with zero channels appended up to `channels`."""
        extra = channels - value.shape[-1]
        if extra == 0:
            return value

        def pad(v: Tensor) -> Tensor:
            if v.is_symbolic:
                return implementer(Role.PAD)(v, [0, extra])
            return from_torch(torch.nn.functional.pad(v.torch(), (0, extra)))

        return self._once(value, "pad", pad)

    def plan(self, node: Operator) -> None:
        """Add `node` to the new graph, channels-last where it can be."""
        planned = plan_of(node.definition)(self, node)
        outs, in_nhwc = planned or (reapply(node, [self.nchw(t) for t in node.inputs]), False)
        for old, new in zip(node.outputs, outs):
            self.new[id(old)] = new
            if in_nhwc:
                self.nhwc_ids.add(id(old))


def permuted(t: Tensor, order) -> Tensor:
    """`t` permuted by `order`: computed now for a constant; `t`'s own source where `t` is a
    permute that `order` undoes, one permute of that source where it composes with one; a
    reshape where only size-1 dims move; a permute node otherwise."""
    if not t.is_symbolic:
        return from_torch(t.torch().permute(*order).contiguous())
    node = producer(t)
    inner = None if node is None else permutation(node)
    if inner is not None:
        order = tuple(inner[k] for k in order)
        source = node.inputs[0]
        return source if order == tuple(range(len(order))) else permuted(source, order)
    moved = [k for k in order if t.shape[k] != 1]
    if moved == sorted(moved):
        return reshaped(t, permuted_shape(t.shape, order))
    return implementer(Role.PERMUTE)(t, list(order))


def reshaped(t: Tensor, shape) -> Tensor:
    """`t` in `shape`: computed now for a constant, a reshape node otherwise."""
    if not t.is_symbolic:
        return from_torch(t.torch().reshape(shape).contiguous())
    return implementer(Role.RESHAPE)(t, list(shape))


# Each plan gives (a node's outputs, whether they are channels-last), or None where the node
# keeps NCHW.

def plan_convolution(p: _Planner, node: Operator):
    """A convolution as its channels-last form, its input's channels padded (see the module
    docs)."""
    if id(node) not in p.convolutions:
        return None
    args = arguments_of(node)
    groups = args["groups"]
    x = p.nhwc(args["x"])
    weight = p.convert(p.nchw(args["weight"]), NCHW_TO_NHWC)
    bias = None if args["bias"] is None else p.nchw(args["bias"])
    if groups == 1:             # a grouped weight holds C / groups channels: nothing to pad
        channels = padded_channels(x.shape[-1], groups)
        x, weight = p.channels_padded(x, channels), p.channels_padded(weight, channels)
    form = provided(node.definition.traits.channels_last)
    return [form(x, weight, bias, args["stride"], conv_padding(node), args["dilation"], groups, **_tf32(node))], True


def plan_through_view(p: _Planner, node: Operator):
    """An operator of `Layout.OWN_DEFINITION` on channels-last data, through
    `in_channels_last`."""
    args = arguments_of(node)
    first = next(iter(node.definition.signature.parameters))
    data = args[first]
    if (not isinstance(data, Tensor) or not p.is_nhwc(data) or len(node.outputs) != 1
            or node.outputs[0].ndim != 4):
        return None
    names, operands, attributes = [], [], []
    for name, v in args.items():
        if name == first:
            continue
        if isinstance(v, Tensor):
            names.append(name)
            operands.append(p.nchw(v))
        elif isinstance(v, list) and any(isinstance(e, Tensor) for e in v):
            return None
        else:
            attributes.append((name, v))
    return [in_channels_last(node.definition)(p.value(data), operands, tuple(names), tuple(attributes))], True


def plan_pad(p: _Planner, node: Operator):
    """A pad (`Role.PAD`) of channels-last data: the same amounts, on the permuted dims."""
    args = arguments_of(node)
    if not p.is_nhwc(args["x"]):
        return None
    amounts = list(args["pad"]) + [0] * (8 - len(args["pad"]))
    sides = {3 - k: amounts[2 * k:2 * k + 2] for k in range(4)}       # NCHW dim -> (before, after)
    pad = [a for k in range(4) for a in sides[NCHW_TO_NHWC[3 - k]]]
    while len(pad) > 2 and pad[-2:] == [0, 0]:
        pad = pad[:-2]
    return [node.definition(**{**args, "x": p.value(args["x"]), "pad": pad})], True


def plan_along_dim(p: _Planner, node: Operator):
    """An operator of `Layout.ALONG_DIM` on 4-D data with a channels-last operand: along the permuted
    dim (channels: the last), on channels-last operands, its 4-D results channels-last."""
    args = arguments_of(node)
    if (not isinstance(args["dim"], int) or any(t.ndim != 4 for t in node.inputs + node.outputs)
            or not any(p.is_nhwc(t) for t in node.inputs)):
        return None
    nhwc = {id(t): p.nhwc(t) for t in node.inputs}
    for name, v in args.items():
        if isinstance(v, Tensor):
            args[name] = nhwc[id(v)]
        elif isinstance(v, list) and any(isinstance(e, Tensor) for e in v):
            args[name] = [nhwc[id(e)] for e in v]
    args["dim"] = NCHW_TO_NHWC.index(args["dim"] % 4)
    outs = node.definition(**args)
    return list(outs) if isinstance(outs, tuple) else [outs], True


def plan_permute(p: _Planner, node: Operator):
    """A permute of channels-last data: one permute of the NHWC value, or none where the model
    itself permutes to NHWC; its result is in no particular layout. A permute of other 4-D data
    to NCHW, (0, 3, 1, 2): none, its result is that data, channels-last."""
    x = node.inputs[0]
    if not p.is_nhwc(x):
        return ([p.value(x)], True) if x.ndim == 4 and tuple(permutation(node)) == NHWC_TO_NCHW else None
    order = tuple(NHWC_TO_NCHW[k] for k in permutation(node))
    value = p.value(x)
    if order == (0, 1, 2, 3):
        return [value], False
    return [p.convert(value, order) if order == NHWC_TO_NCHW else permuted(value, order)], False


def plan_reduction(p: _Planner, node: Operator):
    """A reduction (`Layout.REDUCE_DIMS`) of channels-last data: over the same dims, permuted. With
    keepdim its result is channels-last too; without, it is plain data where the dims kept
    keep their order (a mean over H and W gives (N, C) either way), else the node keeps NCHW."""
    args = arguments_of(node)
    dim = args["dim"]
    if not p.is_nhwc(args["x"]) or dim in ((), []):
        return None
    dims = set(range(4)) if dim is None else {d % 4 for d in ([dim] if isinstance(dim, int) else dim)}
    kept = [NCHW_TO_NHWC.index(d) for d in range(4) if d not in dims]
    if not args["keepdim"] and kept != sorted(kept):
        return None
    moved = sorted(NCHW_TO_NHWC.index(d) for d in dims)
    return [node.definition(**{**args, "x": p.value(args["x"]), "dim": moved})], bool(args["keepdim"])


def plan_elementwise(p: _Planner, node: Operator):
    """An element-wise operator (`is_elementwise`) with a 4-D result and a channels-last
    operand: on channels-last operands."""
    if (node.outputs[0].ndim != 4 or not any(t.ndim == 4 and p.is_nhwc(t) for t in node.inputs)
            or not is_elementwise(node)):
        return None
    inputs = [p.nhwc(t) if t.ndim == 4 else p.broadcast_nhwc(t) for t in node.inputs]
    outs = reapply(node, inputs)
    want = permuted_shape(node.outputs[0].shape, NCHW_TO_NHWC)
    return (outs, True) if outs[0].shape == want else None


PLANS = {Layout.OWN_DEFINITION: plan_through_view, Layout.ALONG_DIM: plan_along_dim,
         Layout.REDUCE_DIMS: plan_reduction}


def plan_of(definition: OperatorDef):
    """The plan for nodes of the operator `definition`, by its traits."""
    traits = definition.traits
    if traits.channels_last is not None:
        return plan_convolution
    if traits.permutation is not None:
        return plan_permute
    if traits.implements is Role.PAD:
        return plan_pad
    return PLANS.get(traits.layout, plan_elementwise)


class PlanLayout(GraphPass):
    """Run convolution-heavy regions channels-last (see the module docs)."""

    name = "plan_layout"
    opt_level = 1

    def transform(self, graph, ctx):
        mode = ctx.session.settings.channels_last
        if any(implementer(role) is None for role in ROLES_USED):
            return graph
        convolutions = [n for n in graph.nodes if n.definition.traits.channels_last is not None]
        taken = {id(n) for n in convolutions if runs_channels_last(n, mode, ctx.session)}
        if not taken or (mode == "auto" and len(taken) < len(convolutions)):
            return graph
        planner = _Planner(taken)
        for node in graph.nodes:
            planner.plan(node)
        return trace_from([planner.nchw(t) for t in graph.outputs], graph.inputs)

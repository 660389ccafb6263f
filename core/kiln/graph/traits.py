"""Operator traits: what an operator declares about itself for the core.

A pass never asks an operator's name; it reads the traits its definition carries, declared
next to the definition:

    @operator("matmul", traits=Traits(tf32=TF32.MATMUL, implements=python.matmul))
    def matmul(x, y, allow_tf32=False):
        ...

so that a plugin's operator takes part in a pass exactly as a built-in one does. An operator
declaring no traits gets `Traits()`, every trait off. Where the core itself builds a node (a
dtype conversion, a layout conversion, `a + b` on kiln Tensors), it asks for the operator
implementing the job (`kiln.plugins.registry().implementing(job)`), never for a name.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Callable


class Role(Enum):
    """A job the core hands to whichever operator declares it (`Traits(implements=Role.CAST)`).
    Each role fixes the arguments its operator takes."""

    CAST = auto()
    """`(input, dtype)`: `input` converted to `dtype` (a name, a torch dtype or a DataType), as
    Tensor.to converts. Float16 conversion, autocast and in-place results cast with it."""
    PERMUTE = auto()
    """`(x, dims)`: `x` with its dims permuted (output dim k is input dim dims[k]). Layout
    planning converts between NCHW and NHWC with it."""
    RESHAPE = auto()
    """`(x, shape)`: `x`'s elements, in row-major order, in `shape`."""
    PAD = auto()
    """`(x, pad, mode="constant", value=0)`, as torch.nn.functional.pad. Layout planning pads
    channels with it, and carries channels-last data through its nodes."""


class TF32(Enum):
    """The permission under which an operator's float32 products may run on TF32 tensor cores
    (`Traits(tf32=...)`). Its value is the setting (`kiln.settings.Settings`) that carries the
    permission, which the torch backend copies from torch's flag of the same kind."""

    MATMUL = "allow_tf32"
    """Matrix products: torch's `torch.backends.cuda.matmul.allow_tf32`."""
    CONVOLUTION = "allow_tf32_convolution"
    """Convolutions: torch's `torch.backends.cudnn.allow_tf32` (True by default)."""


class Layout(Enum):
    """How layout planning (`kiln.passes.layout`) carries channels-last data through an
    operator's nodes (`Traits(layout=...)`). Without one, a node is planned as element-wise
    where its task is, and reads NCHW data otherwise."""

    OWN_DEFINITION = auto()
    """Its definition runs on channels-last data read through a view of its first argument
    (`kiln.passes.channels_last.in_channels_last`): pooling, batch norm."""
    ALONG_DIM = auto()
    """It works along the dim of its int argument `dim` (concatenation, split, slice, softmax):
    on channels-last operands, along the permuted dim."""
    REDUCE_DIMS = auto()
    """It reduces its argument `x` over the dims of `dim` (None, an int or ints), keeping them
    where `keepdim` is set: on channels-last data, over the permuted dims."""


@dataclass(frozen=True)
class Traits:
    """The traits of one operator definition (`OperatorDef.traits`)."""

    tf32: TF32 | None = None
    """A product whose float32 operands a GPU may round to TF32 when the permission it names
    allows it (`TF32.MATMUL`, `TF32.CONVOLUTION`; True, as plugins wrote it before there were
    two, is `TF32.MATMUL`): the definition takes an `allow_tf32` attribute, which the
    `allow_tf32` pass sets and a template may read (the definition's values do not change).
    Its first two tensor arguments are the factors of its products, which the pass rounds to
    TF32 where they are constants of a convolution (`kiln.passes.tf32`)."""
    implements: Role | Callable | None = None
    """The job it does for the core: a `Role`, or a function of Python's `operator` module
    (`operator.add`: kiln Tensors' `a + b` and `b + a` apply this operator to `(a, b)` and
    `(b, a)`). At most one operator name implements each job."""
    layout: Layout | None = None
    """How layout planning carries channels-last data through its nodes."""
    channels_last: str | None = None
    """For a 2-D convolution `(x, weight, bias, stride, padding, dilation, groups)` of NCHW
    data: the name of the operator computing it on channels-last data (x (N, H, W, C), weight
    (O, kH, kW, C / groups), padding a pair of ints; `allow_tf32=True` too where the
    convolution's node has it, `tf32` being declared by both). Layout planning starts
    channels-last regions at such convolutions."""
    view: bool = False
    """Its output is its first input's elements in the same row-major order, in another shape
    (reshape, flatten, squeeze): a node of it is compiled as a view of that input's memory
    (`kiln.runtime.compiled_graph.View`), with no kernel, unless it is a graph output."""
    permutation: Callable | None = None
    """For an operator that only moves its input's dims: `permutation(node)`, the order a node
    of it applies (output dim k is input dim order[k]). Layout planning composes such nodes
    with its conversions."""
    expensive: bool = False
    """Each element costs many instructions (a counter-based random draw): passes that trade
    memory traffic for computation (`kiln.passes.recompute`) never copy a node of it into its
    readers."""
    compares_elements: bool = False
    """Its result counts how the elements of its first input compare with each other (ranks:
    sort, top-k, median): every read of an element must see the same value. Fusion computes
    that input in a kernel of its own, never inside this operator's, where a fused producer is
    evaluated once per read (in a vectorized loop and in a scalar one, say, whose last bits can
    differ: two elements would take one rank, and the positions found from the ranks would be
    wrong)."""
    updates: Callable | None = None
    """For an operator whose result is one of its tensor arguments with some elements replaced
    (an index copy, a scatter whose last source wins): `updates(**arguments)`, called with the
    definition's own arguments (tensors as its `TensorInput`s), returns an `Update` saying which
    elements it replaces and by what, or None for a call that does not only replace elements
    (one that accumulates). Where such a result is written back into a graph input that nothing
    reads afterwards, the graph updates that input in place, writing only those elements
    (`kiln.passes.in_place`)."""
    in_place: str | None = None
    """The name of a tensor argument whose memory the result may take: the result has that
    argument's shape and dtype, and every kernel computing it (the definition's, and those of
    the templates taking its task) reads that argument's element p only where it computes the
    result's element p, before writing it, and reads it through no other argument (a scatter
    that starts from `x` and adds the sources into it: read x[p], write out[p], then combine;
    as a separate launch, or within each element). Where that argument is an intermediate that
    nothing reads after the node (no other node, no view, not a graph output), the compiled
    graph gives the result the argument's buffer (`kiln.graph.compile.in_place_input`): an
    embedding's gradient is scattered into its zero fill rather than into a second buffer of
    the table's size. The core checks the definition's side (its compute loads the argument at
    the result's own index only); a template taking the task must keep the promise itself."""

    def __post_init__(self):
        if isinstance(self.tf32, bool):
            object.__setattr__(self, "tf32", TF32.MATMUL if self.tf32 else None)


@dataclass(frozen=True)
class Update:
    """The elements an operator's call replaces in its argument `target` (a `TensorInput` of
    the call): for each source element s (a multi-index over the extents `sources`), the
    element of `target` at `position(s)` (one index expression per dim of target, user
    indices wrapped and checked) becomes `value(s)` (an expression, cast to target's dtype
    where it differs). Two sources landing on one element leave the later one's value on the
    CPU; on a GPU which one wins is not fixed (as PyTorch's in-place index_copy_ says)."""

    target: object
    sources: tuple
    position: Callable
    value: Callable

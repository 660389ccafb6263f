"""Training: dynamo graphs that need autograd go through AOTAutograd, and Kiln compiles both halves.

`needs_autograd(gm, example_inputs)` says whether outputs must carry gradients: grad mode is on
and an input or a parameter requires grad. `compile_for_training` then hands the graph to
torch's AOTAutograd, which traces forward and backward to core ATen (`decompositions()`: torch's
core-ATen table and the decompositions of `ALSO_DECOMPOSED`, ops whose parts Kiln maps more
simply than the op itself, and the plugins' own (`register_decomposition`), less the ops that
mapping rules declared with `decompose=False` take whole) and splits them with the min-cut
partitioner Inductor uses, which saves for the backward the values that cost least memory and
lets the backward recompute cheap element-wise ones from them (a log-softmax from the logits and
a per-row statistic, rather than the log-probabilities themselves, in float32 where the logits
are bfloat16). A parameter's autocast copy that it would save, the backward casts again from the
parameter (`recompute_parameter_casts`), and a copy of a saved value in another layout (an
attention's output permuted for its output projection) it makes again from that value
(`recompute_layout_copies`). It never saves a view: Kiln's views are copies, so a saved view
would cost a kernel and the bytes of its base; the base is saved and the backward takes the view
(the forward's linear layers then read their weights untransposed). Both ATen graphs are
compiled by `compile_aten(graph, example_inputs)` (the backend's own path: ATen-level mapping
rules, the unmapped-operator error, fallback_to_eager), random ops seeded per call (`random`).
The backend sends graphs that change tensors in place through views here too, with or without
grad mode: AOTAutograd's functionalization makes their ATen graph pure and copies the new
values into the caller's inputs after each call.

The plugins' graph rewrites (`register_graph_rewrite`) change the dynamo graph first: attention
written out in torch operations becomes one `scaled_dot_product_attention`, whose backward
recomputes the probabilities where a plugin's decomposition fuses it.

Attention (`scaled_dot_product_attention`) that no plugin decomposes is traced through its
math form, so that its backward is matmuls and a softmax rather than a PyTorch kernel's
backward op.

Some ATen ops torch decomposes above autograd (its Python kernels for the `Autograd` and
`CompositeImplicitAutograd` keys: lstm, gru; C++ composites such as scaled_dot_product_attention),
so that they never reach the decomposition table; while Kiln traces, the plugins'
decompositions of such ops take the place of those kernels (`plugins_decompose_first`).
"""
from __future__ import annotations

import contextlib
import copy
import threading
from typing import Callable

import torch
from torch._C import DispatchKey
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx import GraphModule
from torch.nn.attention import SDPBackend, sdpa_kernel

from kiln.frontend.torch.graph_rewrites import rewrite_graph
from kiln.frontend.torch.input_free import build_where_used, recompute_input_free
from kiln.frontend.torch.layout_copies import recompute_layout_copies
from kiln.frontend.torch.parameter_casts import recompute_parameter_casts
from kiln.frontend.torch.saved_layout import saved_in_memory_order
from kiln.frontend.torch.random import Seeded, draw_seeds, seed_random_ops
from kiln.frontend.torch.registry import mapping_registry

_aten = torch.ops.aten
ALSO_DECOMPOSED = (
    _aten.native_batch_norm.default,                  # var_mean and element-wise ops,
    _aten._native_batch_norm_legit.default,           # running statistics included
    _aten._native_batch_norm_legit_functional.default,
    _aten._native_batch_norm_legit_no_training.default,
    _aten.native_dropout.default,                     # rand_like, a comparison, a product
)


def decompositions() -> dict:
    """The decomposition table handed to AOTAutograd."""
    registry = mapping_registry()
    table = {**core_aten_decompositions(), **get_decompositions(list(ALSO_DECOMPOSED)),
             **registry.decompositions()}
    whole = registry.undecomposed()
    return {op: fn for op, fn in table.items() if op not in whole}


_ABOVE_AUTOGRAD = (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd)


_swap_lock = threading.Lock()
_swap_users = 0                     # traces inside plugins_decompose_first now
_swapped: list = []                 # (op, key, torch's kernel) while _swap_users > 0


@contextlib.contextmanager
def plugins_decompose_first():
    """Within the block, each plugin decomposition (`register_decomposition`) of an op that
    torch implements above autograd (in Python, or in C++ as a composite) replaces those
    kernels, which would otherwise decompose the op before the decomposition table is asked;
    torch's are restored
    when the last block open in the process closes (blocks may overlap across threads; eager
    calls of those ops in other threads meanwhile run the plugin's decomposition)."""
    global _swap_users
    with _swap_lock:
        if _swap_users == 0:
            for op, fn in mapping_registry().decompositions().items():
                for key in _above_autograd(op):
                    _swapped.append((op, key, op.py_kernels.get(key)))
                    op.py_kernels[key] = fn
                    op._dispatch_cache.clear()
        _swap_users += 1
    try:
        yield
    finally:
        with _swap_lock:
            _swap_users -= 1
            if _swap_users == 0:
                for op, key, kernel in _swapped:
                    if kernel is None:
                        del op.py_kernels[key]
                    else:
                        op.py_kernels[key] = kernel
                    op._dispatch_cache.clear()
                _swapped.clear()


def _above_autograd(op) -> list:
    """The keys above autograd at which `op` has a kernel: its Python kernels there, else its
    C++ CompositeImplicitAutograd kernel (such as scaled_dot_product_attention's, which picks a
    backend's op), which a Python kernel at that key takes the place of."""
    keys = [key for key in _ABOVE_AUTOGRAD if key in getattr(op, "py_kernels", {})]
    if keys or not isinstance(op, torch._ops.OpOverload):
        return keys
    composite = DispatchKey.CompositeImplicitAutograd
    return [composite] if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), composite) else []


def needs_autograd(gm: GraphModule, example_inputs) -> bool:
    """Whether the graph's outputs must be differentiable: grad mode is on and an input or a
    parameter of `gm` requires grad."""
    if not torch.is_grad_enabled():
        return False
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return any(t.requires_grad for t in tensors + list(gm.parameters()))


def compile_for_training(gm: GraphModule, example_inputs, compile_aten: Callable[..., Callable]):
    """`gm` as a differentiable function whose forward and backward ATen graphs are compiled by
    `compile_aten(graph, examples, lent_from, static_inputs)` (the backward when autograd first
    needs it). The outputs from position `lent_from` on are lent by CUDA graphs rather than
    copied: the forward's values saved for the backward (from AOTAutograd's partition; None
    where it did not partition) and all of the backward's gradients, which autograd accumulates
    or hands on and the optimizer reads before they are dropped. The inputs at `static_inputs`
    keep their memory from step to step and are read in place: the forward's parameters and
    buffers (the backward reads in place the forward's lent values and the parameters it saves,
    memory that the forward's captures read in place too; the other values it saves, a batch
    among them, come at new memory each step and are copied)."""
    saved_from: list[int] = []
    # the forward's inputs that are parameters, in AOTAutograd's order (the module's own
    # parameters and buffers lifted first): AOTAutograd's metadata names them only after the
    # partition
    lifted = [t for _, t in (*gm.named_parameters(remove_duplicate=False),
                             *gm.named_buffers(remove_duplicate=False))]
    parameters = [k for k, t in enumerate([*lifted, *example_inputs]) if isinstance(t, torch.nn.Parameter)]

    def partition(joint: GraphModule, joint_inputs, *, num_fwd_outputs: int, **options):
        saved_from.append(num_fwd_outputs)
        with functorch_config.patch(recompute_views=True):
            forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor",
                                                                    num_fwd_outputs=num_fwd_outputs, **options)
        forward, backward = recompute_parameter_casts(*recompute_input_free(forward, backward, num_fwd_outputs),
                                                      num_fwd_outputs, parameters)
        forward, backward = recompute_layout_copies(forward, backward, num_fwd_outputs)
        return saved_in_memory_order(forward, backward, num_fwd_outputs)

    def compile_half(graph: GraphModule, examples, lent_from: int | None, static_inputs: list[int]):
        build_where_used(graph)
        rows, device = seed_random_ops(graph)
        if rows:
            compiled = Seeded(compile_aten(graph, list(examples) + [draw_seeds(rows, device)], lent_from,
                                           static_inputs), rows, device)
        else:
            compiled = compile_aten(graph, list(examples), lent_from, static_inputs)
        return make_boxed_func(compiled)

    def compile_forward(graph: GraphModule, examples):
        return compile_half(graph, examples, saved_from.pop() if saved_from else None, _parameter_positions())

    def compile_backward(graph: GraphModule, examples):
        return compile_half(graph, examples, 0, [])

    backend = aot_autograd(fw_compiler=compile_forward, bw_compiler=compile_backward, partition_fn=partition,
                           decompositions=decompositions())
    rewrite_graph(gm)
    single = _returns_one_value(gm)
    if single:
        gm = _returning_tuple(gm)
    with sdpa_kernel([SDPBackend.MATH]), plugins_decompose_first():
        compiled = backend(gm, example_inputs)
    return (lambda *args: compiled(*args)[0]) if single else compiled


def _parameter_positions() -> list[int]:
    """The positions of the forward graph's inputs that AOTAutograd found to be parameters or
    buffers (memory that stays put from step to step; Inductor's CUDA graphs read them in
    place too)."""
    context = torch._guards.TracingContext.try_get()
    meta = context.fw_metadata if context is not None else None
    return list(getattr(meta, "static_input_indices", None) or [])


def _returns_one_value(gm: GraphModule) -> bool:
    """Whether the graph returns a bare value (symbolic_trace graphs may; dynamo's return tuples)."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    return not isinstance(output.args[0], (tuple, list))


def _returning_tuple(gm: GraphModule) -> GraphModule:
    """A copy of `gm` returning its value in a 1-tuple, as AOTAutograd requires."""
    graph = copy.deepcopy(gm.graph)
    output = next(iter(graph.find_nodes(op="output")))
    output.args = ((output.args[0],),)
    return GraphModule(gm, graph)

"""Recomputation of cheap element-wise values in each reader (`kiln.passes.recompute`): the
batch-norm gradient's pattern (a centred input in float32 and a ReLU mask, each read by two
reductions and an element-wise output) loses its intermediates; views, random values, values
a template produces or reads, and values too costly to recompute stay single."""
import torch

import kiln
from kiln.ir import SymSize, compute
from kiln.passes import PassContext
from kiln.passes.pipeline import optimize
from kiln.passes.recompute import MAX_COPIES, RecomputeCheapProducers, _elements
from tests.passes.passes_support import apply, names, run_both

ops = kiln.ops


def _bn_backward_shape(x, g, mean):
    """Two per-channel sums and an element-wise result over a centred float32 input and a
    masked gradient, as a batch-norm and ReLU backward computes them."""
    centred = ops.sub(ops.cast(x, torch.float32), ops.reshape(mean, [1, -1, 1, 1]))
    masked = ops.where(ops.le(x, 0.0), 0.0, ops.cast(g, torch.float32))
    s1 = ops.sum(masked, [0, 2, 3])
    s2 = ops.sum(ops.mul(masked, centred), [0, 2, 3])
    out = ops.sub(masked, ops.mul(centred, ops.reshape(ops.div(s2, s1), [1, -1, 1, 1])))
    return ops.cast(out, torch.bfloat16)


def test_shared_cheap_values_are_computed_in_each_reader():
    x, g, mean = kiln.symbol([2, 3, 5, 7], "bfloat16"), kiln.symbol([2, 3, 5, 7], "bfloat16"), kiln.symbol([3])
    graph = kiln.trace_from(_bn_backward_shape(x, g, mean), [x, g, mean])
    out = apply(RecomputeCheapProducers(), graph)
    assert names(out).count("Sub") > names(graph).count("Sub")         # the centred input, per reader
    assert names(out).count("Where") == 3                               # the mask, per reader
    with PassContext(opt_level=2, disabled_passes=[RecomputeCheapProducers.name]):
        fused_without = optimize(graph)
    with PassContext(opt_level=2):
        fused_with = optimize(graph)

    def full_size_float32_writes(g):
        return [n.name for n in g.nodes for o in n.outputs if o.numel() > 3 and o.dtype == kiln.dtypes.float32]
    assert full_size_float32_writes(fused_without) and not full_size_float32_writes(fused_with)
    inputs = [kiln.from_torch(torch.randn(2, 3, 5, 7).bfloat16()), kiln.from_torch(torch.randn(2, 3, 5, 7).bfloat16()),
              kiln.from_torch(torch.randn(3))]
    run_both(graph, fused_with, *inputs, atol=1e-2, rtol=1e-2)


def test_symbolic_sizes_copy_as_their_values_do():
    """Element counts of symbolic sizes stay symbolic and compare as guards (`_elements`,
    `kiln.ir.size_reads`): a graph of symbolic sizes copies what the same graph of their values
    copies."""
    def copied(n):
        x, g, mean = kiln.symbol([2, 3, n, 7], "bfloat16"), kiln.symbol([2, 3, n, 7], "bfloat16"), kiln.symbol([3])
        return names(apply(RecomputeCheapProducers(), kiln.trace_from(_bn_backward_shape(x, g, mean), [x, g, mean])))
    n = SymSize.named("s0", 5)
    assert _elements(kiln.symbol([2, n])) == 10 and _elements(kiln.symbol([2, n])).polynomial == (n * 2).polynomial
    assert copied(n) == copied(5) and copied(n).count("Where") == 3


def test_views_random_values_and_costly_values_stay_single():
    x, y, c = kiln.symbol([4, 6]), kiln.symbol([4, 6]), kiln.symbol([4, 6], "bool")
    view = ops.transpose(x, 0, 1)                              # a view read twice
    noise = ops.random_uniform(ops.full([1, 2], 3, dtype=torch.int64), 0, [4, 6])
    costly = ops.where(c, x, y)         # three readers would read 9 bytes for each 4 it saves
    outs = [ops.sum(view, [0]), ops.amax(view, [0]), ops.sum(ops.add(noise, x), [0]),
            ops.amax(ops.add(noise, y), [0]), ops.sum(costly, [1]), ops.amax(costly, [1]), ops.sum(costly, [0])]
    graph = kiln.trace_from(outs, [x, y, c])
    assert names(apply(RecomputeCheapProducers(), graph)) == names(graph)


@kiln.operator("test_expensive_square", traits=kiln.graph.Traits(expensive=True), override=True)
def expensive_square(x):
    return compute(x.shape, lambda *i: x[i] * x[i])


def test_an_operator_declaring_itself_expensive_stays_single():
    """Whoever defines it: the trait, not the name, keeps a node from being copied."""
    x, y = kiln.symbol([4, 6]), kiln.symbol([4, 6])
    square = expensive_square(x)
    graph = kiln.trace_from([ops.sum(ops.add(square, x), [0]), ops.amax(ops.add(square, y), [0])], [x, y])
    assert names(apply(RecomputeCheapProducers(), graph)) == names(graph)
    cheap = ops.mul(x, x)
    graph = kiln.trace_from([ops.sum(ops.add(cheap, x), [0]), ops.amax(ops.add(cheap, y), [0])], [x, y])
    assert names(apply(RecomputeCheapProducers(), graph)) != names(graph)


def test_a_template_epilogue_chain_stays_in_the_epilogue():
    """EfficientNet's squeeze-excite input: SiLU after a batch-normed depthwise convolution,
    read by the pool and by the scaling. It joins the convolution's epilogue (computed once and
    written once); the pool and the scaling read it. A widening cast after the convolution is
    still recomputed by each reader (written once, it would cost twice the bytes)."""
    x = kiln.symbol([2, 9, 7, 12], "float16")
    w, g = kiln.from_torch(torch.randn(12, 3, 3, 1).half()), kiln.symbol([2, 1, 1, 12], "float16")
    scale, shift = kiln.from_torch(torch.rand(12).half() + 0.5), kiln.from_torch(torch.randn(12).half())
    conv = ops.conv2d_channels_last(x, w, padding=1, groups=12)
    act = ops.silu(ops.add(ops.mul(conv, scale), shift))
    gate = ops.sigmoid(ops.mean(act, [1, 2], True))
    graph = kiln.trace_from([ops.mul(act, gate)], [x])
    out = apply(RecomputeCheapProducers(), graph)
    assert names(out).count("Silu") == 1
    fused = optimize(graph)
    conv_groups = [n for n in fused.nodes if "Conv2dChannelsLast" in n.name]
    assert len(conv_groups) == 1 and "Silu" in str(conv_groups[0].fused_graph)
    run_both(graph, fused, kiln.from_torch(torch.randn(2, 9, 7, 12).half()), atol=1e-2, rtol=1e-2)

    widened = ops.cast(ops.conv2d_channels_last(x, w, padding=1, groups=12), torch.float32)
    graph = kiln.trace_from([ops.sum(widened, [0]), ops.amax(widened, [0])], [x])
    assert names(apply(RecomputeCheapProducers(), graph)).count("Cast") == 2


def test_a_widening_cast_is_computed_by_any_number_of_readers():
    """A training backward's convolution whose input gradient (the residual's gradient added, the
    ReLU mask applied) two batch norms' backwards read in float32: the first block of each of
    ResNet's stages, where the block's last batch norm and its shortcut's both read it. Before,
    more readers than MAX_COPIES kept the cast single, and the convolution's epilogue wrote it in
    float32, twice the bytes of its bfloat16 value (ResNet-50's at batch 32: 103 MB at the
    backward's peak). Now each reader casts the bfloat16 value itself."""
    shape = [2, 6, 5, 8]                                        # channels last
    x, residual, relu_out = (kiln.symbol(shape, "bfloat16") for _ in range(3))
    saved_a, saved_b = kiln.symbol(shape, "bfloat16"), kiln.symbol(shape, "bfloat16")
    mean_a, mean_b = kiln.symbol([8]), kiln.symbol([8])
    w = kiln.from_torch(torch.randn(8, 1, 1, 8).bfloat16())
    conv = ops.conv2d_channels_last(x, w)
    grad = ops.cast(ops.where(ops.le(relu_out, 0.0), 0.0, ops.add(conv, residual)), torch.float32)

    def bn_backward(saved, mean):
        centred = ops.sub(ops.cast(saved, torch.float32), ops.reshape(mean, [1, 1, 1, -1]))
        s1, s2 = ops.sum(grad, [0, 1, 2]), ops.sum(ops.mul(grad, centred), [0, 1, 2])
        return ops.cast(ops.sub(grad, ops.mul(centred, ops.reshape(ops.div(s2, s1), [1, 1, 1, -1]))), torch.bfloat16)

    inputs = [x, residual, relu_out, saved_a, saved_b, mean_a, mean_b]
    graph = kiln.trace_from([bn_backward(saved_a, mean_a), bn_backward(saved_b, mean_b)], inputs)
    assert sum(1 for n in graph.nodes for t in n.inputs if t is grad) > MAX_COPIES
    fused = optimize(graph)
    wide = [n.name for n in fused.nodes for o in n.outputs if o.numel() == 480 and o.dtype == kiln.dtypes.float32]
    assert wide == []
    [conv_group] = [n for n in fused.nodes if "Conv2dChannelsLast" in n.name]
    assert [o.dtype for o in conv_group.outputs] == [kiln.dtypes.bfloat16]
    # The fused epilogue rounds conv + residual once, the graph twice (conv, then add): their
    # gradients differ by bfloat16 steps of values near 4 (1/32), which a residual well above
    # zero keeps from being magnified by s2 / s1 (each channel's s1 away from 0).
    values = [kiln.from_torch((torch.randn(*shape) + (4 if k == 1 else 0)).bfloat16()) for k in range(5)]
    values += [kiln.from_torch(torch.randn(8)), kiln.from_torch(torch.randn(8))]
    run_both(graph, fused, *values, atol=0.1, rtol=1e-2)


def test_values_a_reader_takes_part_of_are_computed_in_it():
    """Cross-entropy's forward: a log-sum-exp a row over float32 logits cast from a matrix
    product (also returned), and a gather of the log-probabilities at the targets. Before, the
    cast logits were written between the row kernel and the gather (float32, the logits' size):
    they reach a row statistic, so they were not recomputed. Now the gather, which takes one
    element a row, computes them itself, and so does the row kernel."""
    h, w = kiln.symbol([6, 8], "bfloat16"), kiln.symbol([8, 50], "bfloat16")
    target = kiln.symbol([6, 1], "int64")
    logits = ops.matmul(h, w)
    wide = ops.reshape(ops.cast(ops.reshape(logits, [2, 3, 50]), torch.float32), [6, 50])
    top = ops.amax(wide, [1], True)
    lse = ops.add(ops.log(ops.sum(ops.exp(ops.sub(wide, top)), [1], True)), top)
    loss = ops.sum(ops.gather(ops.sub(wide, lse), 1, target))
    graph = kiln.trace_from([loss, logits, lse], [h, w, target])
    fused = optimize(graph)
    assert [n for n in fused.nodes if any(o.numel() == 300 and o.dtype == kiln.dtypes.float32 for o in n.outputs)] == []
    assert len(fused.nodes) == 3                    # the product, the row kernel, the gathered sum
    inputs = [kiln.from_torch(torch.randn(6, 8).bfloat16()), kiln.from_torch(torch.randn(8, 50).bfloat16()),
              kiln.from_torch(torch.randint(0, 50, (6, 1)))]
    run_both(graph, fused, *inputs, atol=1e-3, rtol=1e-3)

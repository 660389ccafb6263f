"""Random ops of ATen graphs, seeded from torch's generator at every call.

Kiln's kernels keep no generator state, and a seed baked into a graph would be a constant
(folded, the same numbers every step). So `seed_random_ops(gm)` rewrites each uniform random
node (`aten.rand_like`, `aten.rand`) into `seeded_uniform(seeds, row, size_or_like, dtype)`, and
each normal one (`aten.randn_like`, `aten.randn`) into `seeded_normal(...)`, reading row `row` of
one new last placeholder: an int64 tensor of shape (random nodes, 2).
`Seeded` wraps the compiled graph and draws that tensor from torch's generator of the graph's
device on every call, so `torch.manual_seed` makes runs repeatable and every step gets fresh
numbers. A mapping plugin maps `seeded_uniform` to a counter-based Kiln operator; run in
PyTorch (fallback_to_eager) it draws with a torch.Generator seeded from the same row.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

_aten = torch.ops.aten
UNIFORM_OPS = (_aten.rand_like.default, _aten.rand.default, _aten.uniform.default)
NORMAL_OPS = (_aten.randn_like.default, _aten.randn.default)
"""The ATen ops rewritten into `seeded_uniform` and `seeded_normal`; with PyTorch's generator
argument they stay. `aten.uniform(x, from, to)` (numpy's `np.random.rand` as dynamo traces it)
takes x's shape and dtype and is scaled to [from, to)."""
TORCH_RANDOM_CALLS = frozenset({torch.rand, torch.rand_like, torch.randn, torch.randn_like})
"""The torch-level calls whose graphs go through AOTAutograd, where they are seeded."""

SEED_WORD = 1 << 32


def _seeded(draw, name: str):
    def seeded(seeds: torch.Tensor, row: int, size_or_like, dtype=None) -> torch.Tensor:
        like = isinstance(size_or_like, torch.Tensor)
        size = size_or_like.shape if like else size_or_like
        if dtype is None:
            dtype = size_or_like.dtype if like else torch.get_default_dtype()
        generator = torch.Generator(device=seeds.device)
        generator.manual_seed(int(seeds[row, 0]) * SEED_WORD + int(seeds[row, 1]))
        return draw(size, generator=generator, dtype=dtype, device=seeds.device)
    seeded.__name__ = seeded.__qualname__ = name      # how graphs and messages name it
    return seeded


seeded_uniform = _seeded(torch.rand, "seeded_uniform")
"""`seeded_uniform(seeds, row, size_or_like, dtype=None)`: uniform numbers on [0, 1) of the
shape of `size_or_like` (a size, or a tensor whose shape, and without `dtype` dtype, it takes),
keyed by `seeds[row]` (this is the PyTorch implementation; Kiln maps it to its own generator)."""
seeded_normal = _seeded(torch.randn, "seeded_normal")
"""`seeded_normal(seeds, row, size_or_like, dtype=None)`: standard normal numbers, as
`seeded_uniform`."""


def seed_random_ops(gm: GraphModule) -> tuple[int, torch.device]:
    """Rewrite `gm`'s random nodes to read a seeds placeholder (appended last); return how many
    rows of seeds it reads (0: the graph is unchanged) and the device of its numbers."""
    nodes = [n for n in gm.graph.nodes
             if n.target in UNIFORM_OPS + NORMAL_OPS and n.kwargs.get("generator") is None]
    if not nodes:
        return 0, torch.device("cpu")
    value = nodes[0].meta.get("val")
    device = value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    # after the last placeholder, or first in a graph of none (numbers drawn from sizes alone)
    with (gm.graph.inserting_after(placeholders[-1]) if placeholders
          else gm.graph.inserting_before(next(iter(gm.graph.nodes)))):
        seeds = gm.graph.placeholder("kiln_random_seeds")
    seeds.meta["val"] = draw_seeds(len(nodes), device)
    for row, node in enumerate(nodes):
        dtype = node.kwargs.get("dtype")
        with gm.graph.inserting_before(node):
            seeded = seeded_normal if node.target in NORMAL_OPS else seeded_uniform
            new = gm.graph.call_function(seeded, (seeds, row, node.args[0], dtype))
            if node.target is _aten.uniform.default:
                low = node.args[1] if len(node.args) > 1 else node.kwargs.get("from", 0.0)
                high = node.args[2] if len(node.args) > 2 else node.kwargs.get("to", 1.0)
                if (low, high) != (0.0, 1.0):
                    new.meta = dict(node.meta)
                    scaled = gm.graph.call_function(_aten.mul.Tensor, (new, high - low))
                    new = gm.graph.call_function(_aten.add.Tensor, (scaled, low))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.recompile()
    return len(nodes), device


def draws_random_numbers(gm: GraphModule) -> bool:
    """Whether a torch-level graph calls torch.rand, randn or their _like forms: the backend
    then compiles it through AOTAutograd, whose ATen graphs `seed_random_ops` seeds."""
    return any(n.op == "call_function" and n.target in TORCH_RANDOM_CALLS for n in gm.graph.nodes)


def draw_seeds(count: int, device: torch.device) -> torch.Tensor:
    """`count` keys of two 32-bit words from torch's generator of `device`."""
    return torch.randint(0, SEED_WORD, (count, 2), dtype=torch.int64, device=device)


class Seeded:
    """A compiled graph whose last input is the seeds of `seed_random_ops`: called with the
    other inputs, it draws fresh seeds and passes them on."""

    def __init__(self, compiled, count: int, device: torch.device):
        self.compiled = compiled
        self.count = count
        self.device = device

    def __call__(self, *args):
        return self.compiled(*args, draw_seeds(self.count, self.device))

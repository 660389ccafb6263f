"""Kernels launched per forward pass, without and with Kiln's graph optimization.

For ResNet-50 and BERT-base with random weights, compiled by torch.compile(backend="kiln") (on
the CPU unless --device cuda, where CUDA graphs are turned off so every launch counts): one run under `kiln.PassContext(opt_level=0)` (the graph as traced: only level-0
passes run) and one with the default pipeline (constant folding, subgraph rewrites, fusion).
Each run's outputs are checked against eager PyTorch. For the optimized graphs, it also prints
the CompiledGraphs' workspace (all intermediates, placed by the memory plan) against the sum of
the intermediates' sizes (what allocating each one would take).

    python benchmarks/kernel_counts.py [--models resnet50 bert] [--image 64] [--seq 16] [--device cpu]

Kernel counts do not depend on the image size or the sequence length; small ones keep the run
short.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import kiln
from kiln.runtime.compiled_graph import CompiledGraph
from kiln.runtime.backend import DeviceKernel


class Bottleneck(nn.Module):
    """ResNet's bottleneck block (1x1, 3x3, 1x1 convolutions and a shortcut)."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


def resnet50() -> nn.Module:
    """torchvision's ResNet-50 where installed; otherwise the same architecture defined here."""
    try:
        import torchvision
        return torchvision.models.resnet50()
    except ImportError:
        pass
    layers, cin = [], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for k in range(blocks):
            layers.append(Bottleneck(cin, width, stride if k == 0 else 1))
            cin = width * 4
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))


def bert_base() -> nn.Module:
    """BERT-base (12 layers, hidden 768) from transformers, randomly initialized."""
    from transformers import BertConfig, BertModel
    return BertModel(BertConfig(attn_implementation="eager"))


def randomize_batch_norm(model: nn.Module) -> None:
    """Give batch norms non-trivial running statistics, so folding them is really tested."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)


@contextlib.contextmanager
def counting_launches():
    """Count every kernel launch (every call of a loaded kernel, built now or loaded from the
    graph cache) inside the block."""
    count = [0]
    original = DeviceKernel.__call__

    def call(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    DeviceKernel.__call__ = call
    try:
        yield count
    finally:
        DeviceKernel.__call__ = original


@contextlib.contextmanager
def recording_graphs():
    """Collect every CompiledGraph run inside the block (each once)."""
    graphs = {}
    original = CompiledGraph.run

    def run(self, *args, **kwargs):
        graphs[id(self)] = self
        return original(self, *args, **kwargs)

    CompiledGraph.run = run
    try:
        yield graphs
    finally:
        CompiledGraph.run = original


def measure(model: nn.Module, inputs: tuple, opt_level: int | None):
    """(kernels per forward, compile seconds, max abs error vs eager, workspace bytes, bytes of
    intermediates) for one opt level."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad():
        start = time.perf_counter()
        with kiln.PassContext(opt_level=opt_level):
            compiled(*inputs)                     # traces, optimizes and builds the kernels
        seconds = time.perf_counter() - start
        with counting_launches() as launches, recording_graphs() as graphs:
            got = compiled(*inputs)
        want = model(*inputs)
    errors = [(g.float() - w.float()).abs().max().item()
              for g, w in zip(tree_leaves(got), tree_leaves(want)) if isinstance(w, torch.Tensor)]
    for g, w in zip(tree_leaves(got), tree_leaves(want)):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-3)
    workspace = sum(g.workspace_bytes for g in graphs.values())
    intermediates = sum(g.intermediate_bytes for g in graphs.values())
    return launches[0], seconds, max(errors), workspace, intermediates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "bert"], choices=["resnet50", "bert"])
    parser.add_argument("--image", type=int, default=64, help="ResNet-50 input height and width")
    parser.add_argument("--seq", type=int, default=16, help="BERT sequence length")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.device == "cuda":
        from kiln.frontend.torch import dynamo_config
        dynamo_config.use_cuda_graph(False)
    torch.manual_seed(0)
    cases = {
        "resnet50": lambda: (resnet50(), (torch.randn(1, 3, args.image, args.image),)),
        "bert": lambda: (bert_base(), (torch.randint(0, 30522, (1, args.seq)),)),
    }
    print(f"{'model':<10} {'kernels (opt 0)':>16} {'kernels (optimized)':>20} {'compile s':>10} {'max err':>9} "
          f"{'workspace MB':>13} {'intermediates MB':>17}")
    for name in args.models:
        model, inputs = cases[name]()
        randomize_batch_norm(model)
        model = model.to(args.device).eval()
        inputs = tuple(x.to(args.device) for x in inputs)
        plain, _, err0, _, _ = measure(model, inputs, opt_level=0)
        fused, seconds, err, workspace, intermediates = measure(model, inputs, opt_level=None)
        print(f"{name:<10} {plain:>16} {fused:>20} {seconds:>10.1f} {max(err0, err):>9.1e} "
              f"{workspace / 2**20:>13.2f} {intermediates / 2**20:>17.2f}", flush=True)


if __name__ == "__main__":
    main()

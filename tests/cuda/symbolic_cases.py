"""Contraction and attention graphs over a symbolic size s0, for the templates that take sizes
as kernel arguments: the NVRTC test renders them at several sizes (one source, compiled), the
GPU test runs them against PyTorch.

`SymbolicCase.graph(n, device)` traces and optimizes the case's graph at s0 = n; `inputs(n,
device)` makes fresh random inputs (scaled so that 16-bit results stay well inside their
range) and `reference(*inputs)` computes the expected outputs in float32. `gpt_block(n)` is
a GPT-2-like model's optimized graph at s0 = n.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import kiln
from kiln.graph import optimize, trace_from
from kiln.ir import SymSize
from kiln.tensor import symbol

@dataclass
class SymbolicCase:
    """A graph over s0 whose anchor the template `template` takes on a GPU of architecture
    `arch` at the sizes `shared` (which then share one source); `shapes(s)` are the inputs'
    shapes (of SymSizes or ints), of `dtype`, `build(*symbols)` its outputs."""

    name: str
    template: str
    shapes: Callable
    build: Callable
    reference: Callable
    shared: tuple = (9, 17, 131)
    dtype: str = "float16"
    arch: int = 90

    def graph(self, n: int, device: str = "cuda"):
        symbols = [symbol(shape, self.dtype, device) for shape in self.shapes(SymSize.named("s0", n))]
        return optimize(trace_from(list(self.build(*symbols)), symbols))

    def inputs(self, n: int, device: str = "cuda") -> list[torch.Tensor]:
        out = []
        for shape in self.shapes(n):
            x = torch.randn([int(s) for s in shape], device=device)
            out.append((x / shape[-1] ** 0.25 if len(shape) > 1 else x).to(getattr(torch, self.dtype)))
        return out


def _t(x, dims):
    return kiln.ops.permute(x, dims)


def _heads(x):
    """[B, L, H, D] as [B, H, L, D]."""
    return _t(x, (0, 2, 1, 3))


def _attention_prefill(q, k, v):
    out = kiln.ops.attention(_heads(q), _heads(k), _heads(v), is_causal=True)
    return [kiln.ops.reshape(_heads(out), (q.shape[0], q.shape[1], q.shape[2] * q.shape[3]))]


def _prefill_reference(q, k, v):
    h = lambda x: x.float().transpose(1, 2)
    out = F.scaled_dot_product_attention(h(q), h(k), h(v), is_causal=True)
    return [out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)]


def _conv_reference(x, w, b=None, groups=1):
    out = F.conv2d(x.float().permute(0, 3, 1, 2), w.float().permute(0, 3, 1, 2), None if b is None else b.float(),
                   padding=1, groups=groups)
    return out.permute(0, 2, 3, 1)


def _decode_reference(q, k, v):
    group = q.shape[1] // k.shape[1]
    wide = lambda x: x.float().repeat_interleave(group, 1)
    return [F.scaled_dot_product_attention(q.float(), wide(k), wide(v))]


CASES = [
    SymbolicCase("linear_bias_gelu", "gemm_sm90", lambda s: [(2, s, 768), (512, 768), (512,)],
                 lambda x, w, b: [kiln.ops.gelu(kiln.ops.linear(x, w, b), approximate="tanh")],
                 lambda x, w, b: [F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh")]),
    SymbolicCase("scores", "gemm_sm90", lambda s: [(3, s, 64), (3, s, 64)],
                 lambda q, k: [kiln.ops.matmul(q, _t(k, (0, 2, 1))) * 0.125],
                 lambda q, k: [q.float() @ k.float().transpose(1, 2) * 0.125]),
    SymbolicCase("symbolic_k", "gemm_sm90", lambda s: [(3, 64, s), (3, s, 72)],      # TMA: K-major rows of 16 bytes
                 lambda p, v: [kiln.ops.matmul(p, v)], lambda p, v: [p.float() @ v.float()], shared=(24, 40, 136)),
    SymbolicCase("symbolic_batch", "gemm_sm90", lambda s: [(s, 3, 40, 64), (s, 3, 64, 72)],
                 lambda x, y: [kiln.ops.matmul(x, y) + 1.0], lambda x, y: [x.float() @ y.float() + 1.0],
                 shared=(5, 9, 17)),     # 3 * s batches of one tile: less than a wave (`suggest`'s bucket)
    SymbolicCase("gemv_scores", "gemv", lambda s: [(3, 2, 64), (3, s, 64)],
                 lambda q, k: [kiln.ops.matmul(q, _t(k, (0, 2, 1)))],
                 lambda q, k: [q.float() @ k.float().transpose(1, 2)]),
    SymbolicCase("attention_prefill", "attention_flash", lambda s: [(2, s, 4, 64)] * 3, _attention_prefill,
                 _prefill_reference, shared=(9, 17, 100)),          # one key tile: attention_sm90 declines
    SymbolicCase("attention_decode", "attention_decode", lambda s: [(1, 8, 1, 128)] + [(1, 2, s + 300, 128)] * 2,
                 lambda q, k, v: [kiln.ops.attention(q, k, v)], _decode_reference),
    SymbolicCase("linear_f32", "matmul_simt", lambda s: [(2, s, 96), (80, 96)],
                 lambda x, w: [kiln.ops.relu(kiln.ops.linear(x, w))], lambda x, w: [torch.relu(F.linear(x, w))],
                 shared=(9, 11, 15), dtype="float32"),        # M = 2 * s in one bucket: `split_k.rank`'s ranking
    SymbolicCase("linear_sm80", "matmul_tc", lambda s: [(2, s, 768), (512, 768)],
                 lambda x, w: [kiln.ops.linear(x, w)], lambda x, w: [F.linear(x.float(), w.float())],
                 shared=(9, 11, 15), arch=80),
    SymbolicCase("conv_batch", "conv_sm90", lambda s: [(s, 9, 11, 64), (96, 3, 3, 64), (96,)],
                 lambda x, w, b: [kiln.ops.relu(kiln.ops.conv2d_channels_last(x, w, b, padding=1))],
                 lambda x, w, b: [torch.relu(_conv_reference(x, w, b))], shared=(3, 5, 7)),
    SymbolicCase("conv_batch_sm80", "conv_tc", lambda s: [(s, 9, 11, 64), (96, 3, 3, 64), (96,)],
                 lambda x, w, b: [kiln.ops.relu(kiln.ops.conv2d_channels_last(x, w, b, padding=1))],
                 lambda x, w, b: [torch.relu(_conv_reference(x, w, b))], shared=(3, 5, 7), arch=80),
    SymbolicCase("depthwise_batch", "conv_depthwise_nhwc", lambda s: [(s, 9, 11, 64), (64, 3, 3, 1)],
                 lambda x, w: [kiln.ops.conv2d_channels_last(x, w, None, padding=1, groups=64)],
                 lambda x, w: [_conv_reference(x, w, groups=64)], shared=(3, 5, 7)),
]


def gpt_block(length: int, device: str = "cuda", vocab: int = 512, d: int = 128, heads: int = 2):
    """A GPT-2-like model over token ids [2, length] (its parameters graph inputs after the
    ids): token and position embeddings, a pre-norm block (fused qkv linear, causal attention
    over [B, L, H, D] views, projection, tanh-GELU MLP, residuals), a final norm and the head."""
    s = SymSize.named("s0", length)
    h = lambda *shape: symbol(shape, "float16", device)
    idx, pos = symbol((2, s), "int64", device), symbol((s,), "int64", device)
    wte, wpe, ln, qkv, qkv_b, proj, fc, out, head = (h(vocab, d), h(512, d), h(d), h(3 * d, d), h(3 * d), h(d, d),
                                                     h(4 * d, d), h(d, 4 * d), h(vocab, d))
    x = kiln.ops.embedding(idx, wte) + kiln.ops.embedding(pos, wpe)
    q, k, v = kiln.ops.split(kiln.ops.linear(kiln.ops.layer_norm(x, (d,), ln, ln), qkv, qkv_b), d, 2)
    split = lambda t: kiln.ops.permute(kiln.ops.reshape(t, (2, s, heads, d // heads)), (0, 2, 1, 3))
    a = kiln.ops.attention(split(q), split(k), split(v), is_causal=True)
    x = x + kiln.ops.linear(kiln.ops.reshape(kiln.ops.permute(a, (0, 2, 1, 3)), (2, s, d)), proj, ln)
    mlp = kiln.ops.gelu(kiln.ops.linear(kiln.ops.layer_norm(x, (d,), ln, ln), fc), approximate="tanh")
    x = x + kiln.ops.linear(mlp, out, ln)
    logits = kiln.ops.linear(kiln.ops.layer_norm(x, (d,), ln, ln), head)
    return optimize(trace_from([logits], [idx, pos, wte, wpe, ln, qkv, qkv_b, proj, fc, out, head]))

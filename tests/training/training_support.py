"""Helpers of the training tests: tiny models, and optimizer steps run eagerly and through Kiln."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kiln.frontend.torch import KilnFunction


class Block(nn.Module):
    """A residual basic block (two 3x3 convolutions with batch norm), projecting when needed."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.project = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        """torchvision's way: in-place ReLUs and residual add."""
        skip = x if self.project is None else self.project(x)
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)), inplace=True)))
        out += skip
        return F.relu(out, inplace=True)


class TinyResNet(nn.Module):
    """Stem (convolution with bias, batch norm, max pool), two stages, pooled linear head, and a
    cross-entropy loss."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, 1, 1), nn.BatchNorm2d(6), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.stages = nn.Sequential(Block(6, 6), Block(6, 10, stride=2))
        self.head = nn.Linear(10, classes)

    def forward(self, x, labels):
        features = F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1)
        return F.cross_entropy(self.head(features), labels)


def resnet_case(seed: int = 0, shape=(4, 3, 11, 13), memory_format=torch.contiguous_format):
    """TinyResNet and 4 batches of images of `shape`, both in `memory_format`."""
    torch.manual_seed(seed)
    model = TinyResNet().to(memory_format=memory_format)
    batches = [(torch.randn(shape).to(memory_format=memory_format), torch.randint(0, 5, shape[:1]))
               for _ in range(4)]
    return model, batches


def _transformer_batches(vocab: int, count: int = 4, batch: int = 2, length: int = 7):
    ids = [torch.randint(0, vocab, (batch, length)) for _ in range(count)]
    return [(i, torch.randint(0, vocab, (batch, length))) for i in ids]


class LanguageModel(nn.Module):
    """A transformers model returning its loss for (input ids, labels)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


def bert_case(seed: int = 0, dropout: float = 0.0):
    import transformers
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout)
    return LanguageModel(transformers.BertForMaskedLM(config)), _transformer_batches(40)


def llama_case(seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=24, max_position_embeddings=16)
    return LanguageModel(transformers.LlamaForCausalLM(config)), _transformer_batches(40)


def check(fn, *inputs, rtol=1e-4, atol=1e-5):
    """fn(*inputs) and the gradients of every floating-point input, Kiln against eager."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor)
              else t for t in inputs]
    out = torch.compile(fn, backend="kiln")(*leaves)
    assert out.requires_grad
    weights = torch.randn(out.shape)
    (out * weights).sum().backward()
    got = [t.grad for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    for t in leaves:
        if isinstance(t, torch.Tensor):
            t.grad = None
    expected = fn(*leaves)
    (expected * weights).sum().backward()
    want = [t.grad for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    assert all(g is not None for g in got)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
}


@dataclass
class Run:
    """Losses of each step, each parameter's gradient after the first step, and the parameters
    and buffers (batch norm's running statistics) after the last."""

    losses: list[float] = field(default_factory=list)
    first_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    kiln_graphs: int = 0   # graphs Kiln compiled and ran (forward and backward halves)


def train(model: nn.Module, batches, optimizer: str, steps: int, compile_with=None,
          seed: int = 1) -> Run:
    """`steps` optimizer steps of a copy of `model` in train mode, cycling through `batches`;
    the forward compiled with torch.compile(backend=compile_with) when given."""
    model = copy.deepcopy(model).train()
    before = {id(f) for f in KilnFunction.live()}
    step_fn = model if compile_with is None else torch.compile(model, backend=compile_with)
    opt = OPTIMIZERS[optimizer](model.parameters())
    torch.manual_seed(seed)
    run = Run()
    for step in range(steps):
        inputs = batches[step % len(batches)]
        opt.zero_grad()
        loss = step_fn(*inputs)
        loss.backward()
        if step == 0:
            run.first_grads = {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}
        opt.step()
        run.losses.append(loss.item())
    run.state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    run.kiln_graphs = sum(1 for f in KilnFunction.live() if id(f) not in before and f.graphs)
    return run

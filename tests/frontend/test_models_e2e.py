"""End-to-end models through torch.compile(backend="kiln") on the CPU, against eager."""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.frontend.torch import (
    KilnModule, mapping_registry, register_function, register_method, register_module,
)

from frontend_support import compile_and_compare, run_traced

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    """ResNet-18's structure at toy width: stem, two stages of basic blocks, pooled head."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _randomize_batch_norms(model):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model.eval()


def test_resnet():
    torch.manual_seed(0)
    model = _randomize_batch_norms(TinyResNet())
    capture, _ = compile_and_compare(model, torch.randn(2, 3, 16, 16))
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    assert len(graph.inputs) == 1, "parameters and buffers must be constants, not inputs"


def test_bert_with_padding_mask():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=16)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    compile_and_compare(model, input_ids=ids, attention_mask=mask)


def test_gpt2_causal_lm():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :2] = 0
    compile_and_compare(model, input_ids=ids, attention_mask=mask, use_cache=False)


def _module_model():
    torch.manual_seed(0)
    return _randomize_batch_norms(nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, groups=2), nn.Hardswish(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(16, 12), nn.GELU(approximate="tanh"), nn.LayerNorm(12), nn.Dropout(0.3),
        nn.Linear(12, 5), nn.Softmax(dim=-1)))


def test_module_rules_on_call_module_graphs():
    """torch 2.13 ignores inline_inbuilt_nn_modules=False (dynamo always inlines), so the graph
    with call_module nodes comes from torch.fx.symbolic_trace, as the backend receives it."""
    model, x = _module_model(), torch.randn(2, 3, 8, 8)
    gm = run_traced(model, x)
    assert sum(n.op == "call_module" for n in gm.graph.nodes) == len(model)
    inlined, _ = compile_and_compare(model, x)
    assert not any(n.op == "call_module" for n in inlined.graphs[0].graph.nodes)


class GuideModel(nn.Module):
    """The model of the seed guide: nn.Linear, F.relu, operator.add and Tensor.flatten."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10)

    def forward(self, x):
        x = self.linear(x)
        x = F.relu(x)
        x = x + x
        return x.flatten()


@pytest.fixture
def guide_rules_removed():
    registry = mapping_registry()
    targets = [F.relu, operator.add, nn.Linear, torch.Tensor.flatten]
    removed = [r for t in targets for r in registry.remove(t)]
    yield
    for t in targets:
        registry.remove(t)
    for rule in removed:
        registry.add(rule)


def test_guide_example_rules_removed_and_added_back(guide_rules_removed):
    model, x = GuideModel().eval(), torch.randn(10, 10)
    with pytest.raises(kiln.UnmappedOperatorError) as info:
        run_traced(model, x)
    message = str(info.value)
    names = ["operator.add", "torch.Tensor.flatten", "torch.nn.Linear", "torch.nn.functional.relu"]
    assert [n for n in names if n in message] == names
    assert message.index("operator.add") < message.index("torch.nn.functional.relu")
    assert "CONTRIBUTING.md" in message

    @register_function(F.relu)
    def torch_relu(x, inplace=False):
        return kiln.ops.relu(x)

    @register_function(operator.add)
    def operator_add(x, y):
        return kiln.ops.add(x, y)

    @register_module(nn.Linear)
    class KilnLinear(KilnModule):
        def __init__(self, torch_module):
            super().__init__(torch_module)
            self.transposed_weight = kiln.ops.transpose(self.param("weight"), 1, 0)
            self.bias = self.param("bias", optional=True)

        def __call__(self, x):
            y = kiln.ops.matmul(x, self.transposed_weight)
            return y if self.bias is None else y + self.bias

    with pytest.raises(kiln.UnmappedOperatorError, match="torch.Tensor.flatten"):
        run_traced(model, x)

    @register_method(torch.Tensor.flatten)
    def tensor_flatten(self, start_dim=0, end_dim=-1):
        return kiln.ops.flatten(self, start_dim=start_dim, end_dim=end_dim)

    run_traced(model, x, atol=3e-3, rtol=3e-3)
    compile_and_compare(model, x, atol=3e-3, rtol=3e-3)

"""An embedding's gradient on a CUDA GPU (the operator `embedding_backward`, the template
`embedding_grad`) against float64: runs of one index across many chunks of sorted tokens
(hot tokens, every token equal), a single token, widths below and above a block's columns, a
padding row, int32 indices, every knob setting; deterministic (two runs give the same bits);
an index out of range traps; an nn.Embedding and a tied GPT-2 under bfloat16 autocast trained
through torch.compile, with no float32 table in the backward.

Each row of the result must be the float32 sum of its tokens' rows (float64 for float64),
rounded once to the table's dtype: within half a unit of that dtype of the exact sum, plus
float32's accumulation error (each sum runs in token order, chunk by chunk, so its last bits of
float32 may differ from a sequential sum's)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import kiln
from kiln.plugins.registry import registry
from tests.support import rand

pytestmark = pytest.mark.cuda


DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _exact(grad, indices, rows, padding_idx=-1):
    out = torch.zeros(rows, grad.shape[1], dtype=torch.float64).index_add_(0, indices.cpu().long(),
                                                                           grad.cpu().double())
    if 0 <= padding_idx < rows:
        out[padding_idx] = 0
    return out


def _check(got, grad, indices, rows, padding_idx=-1):
    """`got` within half a unit of its dtype of the exact sums, plus float32's (float64's)
    accumulation error, bounded by the sum of the absolute values summed."""
    exact = _exact(grad, indices, rows, padding_idx)
    magnitude = _exact(grad.abs(), indices, rows, padding_idx)
    unit = torch.finfo(got.dtype).eps / 2
    accumulation = (2.0 ** -52 if got.dtype == torch.float64 else 2.0 ** -23) * indices.numel()
    error = (got.cpu().double() - exact).abs()
    bound = unit * exact.abs() + accumulation * magnitude + 1e-30
    assert got.dtype == grad.dtype and got.shape == exact.shape
    assert (error <= bound).all(), f"largest error {error.max().item():.3g}, at {(error - bound).argmax().item()}"
    if 0 <= padding_idx < rows:
        assert not got[padding_idx].any()


def _hot(rows, tokens, hot=(0, 1, 5)):
    """Indices of which 80% hit a few hot rows."""
    index = torch.randint(0, rows, (tokens,))
    return torch.where(torch.rand(tokens) < 0.8, torch.tensor(hot)[torch.randint(0, len(hot), (tokens,))], index)


CALLS = {   # tokens, width, rows, indices, padding_idx
    "hot_rows": (3000, 300, 1000, lambda: _hot(1000, 3000), -1),
    "all_equal": (5000, 33, 7, lambda: torch.full((5000,), 3), -1),
    "single_token": (1, 2049, 50, lambda: torch.tensor([49]), -1),
    "ragged_chunks": (997, 1, 13, lambda: torch.randint(0, 13, (997,)), -1),
    "padding_hot": (2000, 64, 100, lambda: _hot(100, 2000), 1),
    "wide": (300, 2049, 40000, lambda: torch.randint(0, 40000, (300,)), 7),
}


def test_the_template_takes_the_gradient_on_this_gpu():
    from kiln.runtime.cuda import arch_number, device_info
    from kiln.schedule import schedules_for
    definition = registry().operator("embedding_backward")
    args = [kiln.from_torch(torch.randn(8, 4, device=DEVICE)), kiln.from_torch(torch.zeros(8, dtype=torch.int64,
                                                                                           device=DEVICE)), 5]
    task = definition.task(definition.bind(args, {}))[0]
    assert schedules_for(task, "cuda", arch_number(device_info(0)["arch"]))[0].name == "embedding_grad"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("call", list(CALLS))
def test_embedding_backward(call, dtype):
    torch.manual_seed(0)
    tokens, width, rows, make, padding_idx = CALLS[call]
    grad, indices = rand((tokens, width), dtype), make()
    got = kiln.ops.embedding_backward(grad.to(DEVICE), indices.to(DEVICE), rows, padding_idx=padding_idx).torch()
    _check(got, grad, indices, rows, padding_idx)


def test_int32_indices_and_determinism():
    torch.manual_seed(0)
    grad, indices = rand((4000, 96), torch.bfloat16).to(DEVICE), _hot(500, 4000).int().to(DEVICE)
    first = kiln.ops.embedding_backward(grad, indices, 500).torch()
    _check(first, grad, indices, 500)
    for _ in range(3):
        assert torch.equal(kiln.ops.embedding_backward(grad, indices, 500).torch(), first)


def _knob_settings():
    from kiln_ops_builtin.templates import embedding_grad
    return embedding_grad.TEMPLATE.space(2)


@pytest.mark.parametrize("knobs", _knob_settings(), ids=lambda k: "-".join(f"{n}{v}" for n, v in k.items()))
def test_every_knob_setting(knobs):
    """Each setting on a run of one index over many chunks, hot rows and ragged ends; the
    output starts as NaN, so that every element is written (the zero fill included)."""
    from kiln.runtime.backend import backend_for
    from kiln_ops_builtin.templates import embedding_grad
    torch.manual_seed(0)
    tokens, width, rows = 1999, 515, 300
    grad, indices = rand((tokens, width), torch.bfloat16), _hot(rows, tokens, hot=(0, 299))
    indices[700:1500] = 150
    definition = registry().operator("embedding_backward")
    inputs = [grad.to(DEVICE), indices.to(DEVICE)]
    task = definition.task(definition.bind([kiln.from_torch(t) for t in inputs] + [rows], {"padding_idx": 299}))[0]
    runner = backend_for(kiln.device("cuda")).load(embedding_grad.render(task, **knobs), kiln.device("cuda"))
    out = torch.full((rows, width), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    runner(inputs, [out])
    torch.cuda.synchronize()
    _check(out, grad, indices, rows, 299)


def test_an_index_out_of_range_traps():
    """A trap ends the CUDA context, so the call runs in a process of its own: it fails (the next
    synchronizing call raises), and the device's message names the index."""
    code = textwrap.dedent("""
        import torch, kiln
        grad = torch.randn(6, 4, device="cuda")
        indices = torch.tensor([0, 1, 9, 2, 0, 1], device="cuda")
        out = kiln.ops.embedding_backward(grad, indices, 5).torch()
        torch.cuda.synchronize()
        print("no failure", out.sum().item())
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=os.environ.copy())
    assert result.returncode != 0, result.stdout
    assert "no failure" not in result.stdout
    output = result.stdout + result.stderr      # the device's printf is flushed at best effort
    assert "index 9 is out of range for a weight of 5 rows" in output or "CUDA error" in output, output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_trained_embedding_against_float64(dtype):
    """nn.Embedding with a padding row through torch.compile on the GPU: its gradient is
    embedding_backward's, within half a unit of the exact one, and the backward holds no
    float32 buffer of the table's shape (for a bfloat16 table: the gradient is made in it)."""
    from kiln.frontend.torch import KilnFunction
    from kiln.frontend.torch.memory import graph_memory
    torch.manual_seed(0)
    vocab, dim = 5003, 96
    embedding = nn.Embedding(vocab, dim, padding_idx=4, dtype=dtype, device=DEVICE)
    ids = _hot(vocab, 4 * 512, hot=(0, 4, 17)).reshape(4, 512).to(DEVICE)
    upstream = torch.randn(4, 512, dim, device=DEVICE).to(dtype)
    compiled = torch.compile(lambda t: (embedding(t) * upstream).float().sum(), backend="kiln",
                             options={"graph_cache": False})
    before = set(KilnFunction.live())
    compiled(ids).backward()
    _check(embedding.weight.grad, upstream.reshape(-1, dim), ids.reshape(-1), vocab, 4)
    memories = [m for f in KilnFunction.live() if f not in before for m in graph_memory(f)]
    assert len(memories) == 2
    tables = [v for m in memories for v in m.largest_intermediates if v.signature.startswith(f"float32[{vocab}, {dim}]")]
    assert not tables, tables


def test_tied_gpt2_under_bfloat16_autocast_against_float64():
    """A two-layer GPT-2 (its token table also the LM head) trained on the GPU under bfloat16
    autocast: the table gradients' error against the float64 model (no autocast) is about
    eager's under the same autocast."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vocab, dim = 5003, 64
    config = transformers.GPT2Config(n_layer=2, n_embd=dim, n_head=4, vocab_size=vocab, n_positions=128,
                                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).to(DEVICE)
    ids = _hot(vocab, 4 * 128).reshape(4, 128).to(DEVICE)

    def grads(m, autocast):
        m.zero_grad()
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in m.named_parameters()}

    got = grads(torch.compile(model, backend="kiln"), True)
    eager = grads(model, True)
    exact = grads(model.double(), False)
    for name in ("transformer.wte.weight", "transformer.wpe.weight"):
        kiln_error = (got[name].double() - exact[name]).abs().max().item()
        eager_error = (eager[name].double() - exact[name]).abs().max().item()
        scale = exact[name].abs().max().item()
        assert kiln_error <= 1.5 * eager_error + 1e-3 * scale, (name, kiln_error, eager_error, scale)

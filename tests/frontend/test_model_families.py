"""Small random configurations of the model families that used to stop at an unmapped operator,
through torch.compile(backend="kiln") on the CPU against eager: nn.MultiheadAttention, einsum
attention and einsum equations (repeated letters: diagonals), a 3-D conv net, BLOOM-style alibi attention (baddbmm), a weight-normed conv
(wav2vec2's positional conv), losses, and an LSTM."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.frontend.torch import kiln_backend
from kiln.frontend.torch.interpreter import Interpreter, MappingError

from frontend_support import compile_and_compare


def _eval(model):
    torch.manual_seed(0)
    return model.eval()


def test_multihead_attention():
    mha = _eval(nn.MultiheadAttention(16, 4, batch_first=True))
    q, kv = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    mask = torch.rand(5, 7) > 0.8

    class Attend(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, q, kv, mask):
            return self.mha(q, kv, kv, attn_mask=mask, need_weights=False)[0]

    compile_and_compare(Attend(), q, kv, mask)


@pytest.mark.parametrize("form", ["key_padding", "float_mask", "unbatched"])
def test_multihead_attention_without_weights_runs_the_attention_operator(form):
    mha = _eval(nn.MultiheadAttention(16, 4, batch_first=True))
    q, kv = torch.randn(3, 5, 16), torch.randn(3, 7, 16)
    padding = torch.rand(3, 7) > 0.7
    padding[:, 0] = False                      # every query keeps a key
    kwargs = {"key_padding": dict(key_padding_mask=padding), "float_mask": dict(attn_mask=torch.randn(5, 7)),
              "unbatched": {}}[form]
    if form == "unbatched":
        q, kv = q[0], kv[0]
    capture, _ = compile_and_compare(lambda q, kv: mha(q, kv, kv, need_weights=False, **kwargs)[0], q, kv)
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    assert "attention" in {n.definition.name for n in graph.nodes}
    assert "softmax" not in {n.definition.name for n in graph.nodes}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
def test_transformer_encoder_fast_path(padded, norm_first, activation):
    """nn.TransformerEncoder in eval mode runs torch._transformer_encoder_layer_fwd per layer,
    with or without a key padding mask. (With a square attention mask PyTorch first asks the
    data whether the mask is causal, `bool(tensor)`, and dynamo breaks the graph there.)"""
    layer = nn.TransformerEncoderLayer(16, 4, 24, activation=activation, norm_first=norm_first, batch_first=True)
    encoder = _eval(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    x = torch.randn(3, 7, 16)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[0, 5:], padding[2, 3:] = True, True
    kwargs = {"src_key_padding_mask": padding} if padded else {}
    capture, _ = compile_and_compare(encoder, x, **kwargs)
    assert torch._transformer_encoder_layer_fwd in {n.target for g in capture.graphs for n in g.graph.nodes}


def test_multihead_attention_with_weights():
    mha = _eval(nn.MultiheadAttention(12, 3, kdim=8, vdim=10))
    q, k, v = torch.randn(4, 2, 12), torch.randn(6, 2, 8), torch.randn(6, 2, 10)
    compile_and_compare(lambda q, k, v: mha(q, k, v), q, k, v)


def test_einsum_attention():
    def attention(q, k, v):
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / 4.0
        return torch.einsum("bhqk,bhkd->bqhd", scores.softmax(-1), v)

    q, k, v = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 8)
    compile_and_compare(attention, q, k, v)


@pytest.mark.parametrize("equation, shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("i,i->", [(7,), (7,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("bij,bjk", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (4, 5)]),
    ("ijk->kj", [(2, 3, 4)]),
    ("ab,bc,cd->ad", [(2, 3), (3, 4), (4, 5)]),
    ("bn,anm,bm->ba", [(2, 3), (4, 3, 5), (2, 5)]),
])
def test_einsum_equations(equation, shapes):
    operands = [torch.randn(s) for s in shapes]
    compile_and_compare(lambda *ops: torch.einsum(equation, *ops), *operands)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("equation, shapes", [
    ("bii->b", [(2, 3, 3)]),
    ("bii->b", [(1, 5, 5)]),
    ("ii->i", [(7, 7)]),
    ("ii", [(4, 4)]),
    ("ii->", [(1, 1)]),
    ("bij,bjj->bi", [(2, 3, 4), (2, 4, 4)]),
    ("bij,bjj->bi", [(3, 5, 7), (3, 7, 7)]),
    ("iji->j", [(3, 2, 3)]),
    ("iij->ji", [(5, 5, 3)]),
    ("...ii->...i", [(2, 3, 4, 4)]),
    ("iiii->i", [(3, 3, 3, 3)]),
    ("ij,jji->ij", [(2, 3), (3, 3, 2)]),
])
def test_einsum_repeated_indices(equation, shapes, dtype):
    """A letter repeated within one operand takes its diagonal, as eager does (issue 30)."""
    operands = [torch.randn(s).to(dtype) for s in shapes]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    compile_and_compare(lambda *ops: torch.einsum(equation, *ops), *operands, atol=tol, rtol=tol)


def test_einsum_repeated_indices_non_contiguous():
    x = torch.randn(4, 6, 6).transpose(1, 2)                 # a transposed batch of squares
    y = torch.randn(6, 4, 6)[:, :, ::1].permute(1, 0, 2)     # (4, 6, 6), permuted
    compile_and_compare(lambda x, y: torch.einsum("bii,bij->bj", x, y), x, y)
    compile_and_compare(lambda x: torch.einsum("bii->bi", x), x)


class Conv3dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm3d(6)
        self.pool = nn.MaxPool3d(2)
        self.up = nn.ConvTranspose3d(6, 4, 2, stride=2)
        self.head = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.conv(x))))
        x = self.head(self.up(x))
        return self.fc(torch.flatten(x, 1))


def test_conv3d_net():
    model = _eval(Conv3dNet())
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    compile_and_compare(model, torch.randn(2, 3, 6, 8, 5))


def test_bloom_alibi_attention():
    """BLOOM's scores: baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(d))."""
    heads, length, d = 4, 6, 8
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)])

    def attention(q, k, v, positions):
        alibi = (slopes[:, None] * positions[None, :])[:, None, :]  # (heads, 1, length)
        scores = torch.baddbmm(alibi, q, k.transpose(1, 2), beta=1.0, alpha=d ** -0.5)
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
        return torch.bmm(F.softmax(scores, -1), v)

    q, k, v = (torch.randn(heads, length, d) for _ in range(3))
    compile_and_compare(attention, q, k, v, torch.arange(length, dtype=torch.float32))


def test_weight_normed_conv():
    """wav2vec2's positional convolution: weight_norm over dim 2, grouped conv, GELU."""
    torch.manual_seed(0)
    conv = nn.utils.weight_norm(nn.Conv1d(8, 8, 5, padding=2, groups=2), name="weight", dim=2)
    compile_and_compare(lambda x: F.gelu(conv(x)), torch.randn(2, 8, 11))


def test_parametrized_weight_norm():
    torch.manual_seed(0)
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 6, 3))
    compile_and_compare(lambda x: conv(x), torch.randn(2, 4, 9))


def test_classifier_losses():
    logits, labels = torch.randn(6, 5), torch.randint(0, 5, (6,))
    labels[2] = -100
    weight = torch.rand(5) + 0.5

    def losses(logits, labels, weight):
        probs = logits.softmax(-1)
        return (F.cross_entropy(logits, labels, weight=weight, label_smoothing=0.1),
                F.cross_entropy(logits, probs, reduction="none"),
                F.nll_loss(logits.log_softmax(-1), labels, reduction="sum"),
                F.binary_cross_entropy_with_logits(logits, probs, pos_weight=weight),
                F.kl_div(logits.log_softmax(-1), probs, reduction="batchmean"),
                F.smooth_l1_loss(logits, probs, beta=0.5), F.huber_loss(logits, probs, delta=0.7))

    compile_and_compare(losses, logits, labels, weight)


def test_lstm_compiles_in_both_graph_forms():
    """An LSTM compiles in Kiln (see README). By default dynamo does not trace RNN modules: it
    breaks the graph there and the LSTM runs eagerly, Kiln compiling the rest; with
    `torch._dynamo.config.allow_rnn` the LSTM reaches Kiln as one torch.lstm node, which Kiln
    unrolls. In a symbolic_trace graph the LSTM module is mapped too."""
    lstm = _eval(nn.LSTM(6, 8, num_layers=2, batch_first=True))
    head = _eval(nn.Linear(8, 3))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = lstm, head

        def forward(self, x):
            out, _ = self.lstm(torch.tanh(x))
            return self.head(out[:, -1])

    def function(x):
        out, _ = lstm(torch.tanh(x) * 2)
        return head(out[:, -1])

    model, x = Model(), torch.randn(2, 5, 6)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(function, backend="kiln")(x), function(x),
                                   atol=1e-5, rtol=1e-5)
    with torch._dynamo.config.patch(allow_rnn=True):
        capture, _ = compile_and_compare(function, x, atol=1e-5, rtol=1e-5)
    assert torch.lstm in {n.target for n in capture.graphs[0].graph.nodes}

    gm = torch.fx.symbolic_trace(model)
    assert not Interpreter(gm).unmapped()
    with torch.no_grad():     # fallback_to_eager is off: every node runs in Kiln
        torch.testing.assert_close(kiln_backend(gm, [x])(x), model(x), atol=1e-5, rtol=1e-5)


def test_transpose_attributes():
    """Regression: x.T raised an internal error in permute (it was given a range); mT and mH."""
    x = torch.randn(3, 4, 5)
    compile_and_compare(lambda x: (x.T + 1, x.mT * 2, x.mH - 1, x[0].T, x[0].H), x)


def _inplace_fills(x, y):
    a, b, c = x.clone(), x.clone(), x.clone()
    a.zero_()
    b.copy_(y[0])
    c.fill_(2.5)
    d = x.clone().scatter_add_(1, torch.tensor([[0, 2, 2, 1, 0]]).expand(3, 5), y)
    return a + 1, b, c, d


LONG_TAIL = {
    "activations": lambda x: (F.glu(x, -1), F.hardshrink(x, 0.3), F.tanhshrink(x),
                              F.softmin(x, 1), F.threshold(x, 0.1, -2.0), F.prelu(x, torch.tensor([0.2]))),
    "softshrink": lambda x: F.softshrink(x, 0.4),
    "special math": lambda x: (torch.logsumexp(x, 1), torch.isclose(x, x + 1e-6), torch.nan_to_num(x.log()),
                               torch.asinh(x), torch.erfc(x), torch.lgamma(x.abs() + 0.5), torch.logit(x.sigmoid()),
                               torch.hypot(x, x.flip(0)), torch.logaddexp(x, 1 - x)),
    "arrangement": lambda x: (torch.rot90(x, 1, (0, 1)), torch.fliplr(x), torch.block_diag(x, x[:2, :3]),
                              torch.cartesian_prod(x[0, :3], x[1, :2]), torch.eye(3, 5) + x[:3, :5],
                              torch.linspace(-1, 2, 7) * 2, torch.tril_indices(4, 3, 1), torch.diag_embed(x),
                              torch.hstack([x, x]), torch.atleast_3d(x), torch.meshgrid(x[0], x[1], indexing="xy")),
    "distances": lambda x: (F.cosine_similarity(x, x.flip(1)), F.pairwise_distance(x, x * 2),
                            torch.cdist(x, x[:2]), torch.outer(x[0], x[1]), torch.addr(x[:, :3], x[:, 0], x[0, :3])),
    "order": lambda x: (torch.sort(x, 1, descending=True), torch.topk(x, 2), x.argsort(0), x.median(1),
                        x.cumprod(1), x.cummax(0), torch.kthvalue(x, 2, 1), x.logcumsumexp(1)),
}


@pytest.mark.parametrize("name", list(LONG_TAIL))
def test_long_tail_rules(name):
    compile_and_compare(LONG_TAIL[name], torch.randn(3, 6))


def test_inplace_fills_and_scatter():
    compile_and_compare(_inplace_fills, torch.randn(3, 5), torch.randn(3, 5))


def test_pixel_and_channel_shuffles_and_norms():
    x = torch.randn(2, 8, 3, 5)

    def fn(x):
        up = F.pixel_shuffle(x, 2)
        return (F.pixel_unshuffle(up, 2), F.channel_shuffle(x, 4), F.instance_norm(x, weight=torch.ones(8) * 2),
                F.local_response_norm(x, 3), F.upsample(x, scale_factor=2, mode="nearest"),
                F.interpolate(x, scale_factor=1.7, mode="bicubic"),
                F.interpolate(x, size=(4, 9), mode="bicubic", align_corners=True))

    compile_and_compare(fn, x)


def test_two_fused_outputs_sharing_an_intermediate():
    compile_and_compare(lambda x: (F.hardshrink(x, 0.3), F.softshrink(x, 0.4)), torch.randn(16, 16))


def test_masked_index_put_and_tensor_narrow():
    def fn(x, mask, start):
        y = x.clone()
        y[mask] = x[0]                      # one row for every selected row
        z = x.index_put((mask,), torch.ones(()), accumulate=True)
        return y, z, x.narrow(1, start, 2)

    x = torch.randn(5, 4)
    compile_and_compare(fn, x, torch.tensor([True, False, True, True, False]), torch.tensor(1))


@pytest.mark.parametrize("shape, mask_dims", [((6, 5), 1), ((6, 5), 2), ((3, 4, 5), 2)])
def test_boolean_mask_write_after_a_graph_break(shape, mask_dims):
    """`out[mask] = y` after `x[mask]` (a graph break: its size depends on the data), for a
    mask over the leading dims (y holds rows) and a scalar y."""
    def write(x, mask):
        y = x[mask] * 2
        out = torch.zeros_like(x)
        out[mask] = y
        return out

    def fill(x, mask):
        out = torch.zeros_like(x)
        out[mask] = 2.5
        return out

    torch.manual_seed(0)
    for fn in (write, fill):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="kiln")
        for _ in range(2):
            x = torch.randn(shape)
            mask = torch.rand(shape[:mask_dims]) > 0.5
            torch.testing.assert_close(compiled(x, mask), fn(x, mask))


class _BufferPadding(nn.Module):
    """Padding by amounts held in buffers (0-dim tensors), as EnCodec's convolutions hold theirs."""

    def __init__(self):
        super().__init__()
        self.register_buffer("left", torch.tensor(3))
        self.register_buffer("right", torch.tensor(2))

    def forward(self, x):
        return F.pad(x, (self.left, self.right), "reflect") * 2


def test_pad_by_0_dim_tensor_amounts():
    """Amounts that are constants of the graph (buffers) or inputs (EnCodec's, after a graph
    break: read as the trace's constants, traced again for new values) are read as ints."""
    compile_and_compare(_eval(_BufferPadding()), torch.randn(1, 4, 9))

    def by_inputs(x, left, right):
        return F.pad(x, (left, right), "reflect") + 1

    torch._dynamo.reset()
    compiled = torch.compile(by_inputs, backend="kiln")
    for left, right in ((5, 1), (3, 2)):
        x, left, right = torch.randn(1, 4, 37), torch.tensor(left), torch.tensor(right)
        torch.testing.assert_close(compiled(x, left, right), by_inputs(x, left, right))


def test_pad_by_amounts_known_only_at_run_time_is_declined():
    """In a symbolic_trace graph a tensor input's value is unknown when Kiln traces it: the pad
    rule declines it (fallback_to_eager runs it in PyTorch: test_fallback.py)."""
    gm = torch.fx.symbolic_trace(lambda x, n: F.pad(x, (0, n)) + 1)
    with pytest.raises(MappingError, match="every Kiln rule for torch.nn.functional.pad declined"):
        kiln_backend(gm, [torch.randn(2, 5), torch.tensor(3)])(torch.randn(2, 5), torch.tensor(3))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_with_offsets_and_padding(mode):
    bag = _eval(nn.EmbeddingBag(50, 6, mode=mode, padding_idx=3))
    ids = torch.tensor([4, 3, 9, 49, 0, 3, 3, 17, 8, 8])
    offsets = torch.tensor([0, 3, 3, 7])                     # bag 1 is empty, bag 2 all but padding
    compile_and_compare(lambda i, o: bag(i, o), ids, offsets)


def test_embedding_bag_2d_input_with_per_sample_weights():
    bag = _eval(nn.EmbeddingBag(30, 5, mode="sum", padding_idx=2))
    ids, weights = torch.randint(0, 30, (4, 7)), torch.rand(4, 7)
    ids[1, 2:5] = 2
    compile_and_compare(lambda i, w: bag(i, per_sample_weights=w), ids, weights)


def test_embedding_bag_include_last_offset():
    weight = torch.randn(20, 4)
    ids, offsets = torch.randint(0, 20, (9,)), torch.tensor([0, 2, 2, 9])
    compile_and_compare(lambda i, o: F.embedding_bag(i, weight, o, mode="mean", include_last_offset=True),
                        ids, offsets)


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_sample(mode, padding_mode, align_corners):
    x = torch.randn(2, 3, 7, 9)
    grid = torch.rand(2, 5, 4, 2) * 3 - 1.5                   # reaches outside [-1, 1] on every side
    compile_and_compare(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode,
                                                   align_corners=align_corners), x, grid)



@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("size", [(2, 3, 7, 9), (1, 1, 1, 5)])
def test_affine_grid_and_a_spatial_transformer(size, align_corners):
    theta = torch.randn(size[0], 2, 3)
    compile_and_compare(lambda t: F.affine_grid(t, list(size), align_corners=align_corners), theta)
    x = torch.randn(size)
    compile_and_compare(lambda x, t: F.grid_sample(x, F.affine_grid(t, list(size), align_corners=align_corners),
                                                   align_corners=align_corners), x, theta)

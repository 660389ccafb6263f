"""torch.fft, torch.stft and complex intermediates through backend="kiln" against eager.

What models use: FNet's token mixing (`fftn(x, dim=(-2, -1)).real`, and transformers' nested
`fft(fft(x, dim=-1), dim=-2).real`), long convolutions (`irfft(rfft(u, n=2L) * rfft(k, n=2L),
n=2L)[..., :L]`), spectrograms (`stft(...).abs()`, `** 2`, `view_as_real`), LLaMA's rotary
embedding on complex numbers (`polar`, `view_as_complex`); with every `norm`, `n=`/`s=` padding
and truncation, `dim=`, odd and non-power-of-two lengths, non-contiguous inputs.

Tolerance: Kiln computes each transform as a product with its basis matrix (a sum of n
products a bin), eager with pocketfft's butterflies: both round differently from the exact
transform. Each result is compared with a float64 eager reference, and Kiln's largest error
must stay within a few times eager float32's own (or a few float32 ulps of the largest value),
so a wrong bin, sign, scale or padding fails by orders of magnitude. float64 is held to 1e-12.
"""
import pytest
import torch

import kiln
from kiln.frontend.torch import dynamo_config

from frontend_support import Capture

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

f32, f64 = torch.float32, torch.float64


def compare(fn, *inputs, device="cpu"):
    """Compile `fn` with Kiln (fullgraph), check every output against a float64 eager
    reference within a few times eager's own error; return the capture."""
    def real_outputs(*args):     # Kiln returns real tensors: complex results as real pairs
        out = fn(*args)
        return tuple(torch.view_as_real(v.resolve_conj()) if v.is_complex() else v
                     for v in (out if isinstance(out, tuple) else (out,)))

    capture = Capture()
    with torch.no_grad():
        expected = real_outputs(*inputs)
        reference = real_outputs(*[t.double() if t.is_floating_point() else t for t in inputs])
        actual = torch.compile(real_outputs, backend=capture, fullgraph=True)(*inputs)
    assert capture.compiled, "the Kiln backend was never called"
    for got, want, exact in zip(actual, expected, reference, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
        scale = exact.abs().max().item() or 1.0
        ours, theirs = (got.double() - exact).abs().max().item(), (want.double() - exact).abs().max().item()
        if want.dtype == f64:
            assert ours <= 1e-12 * scale, f"float64 error {ours:.3g} (scale {scale:.3g})"
        else:
            assert ours <= max(8 * theirs, 4e-6 * scale), \
                f"Kiln's error {ours:.3g}, eager's {theirs:.3g}, largest value {scale:.3g}"
    return capture


def randn(*shape, dtype=f32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


# FNet ------------------------------------------------------------------------------------------

def fnet(x):
    return torch.fft.fftn(x, dim=(-2, -1)).real


def fnet_transformers(x):
    return torch.fft.fft(torch.fft.fft(x, dim=-1), dim=-2).real


@pytest.mark.parametrize("fn, shape, dtype", [(fnet, (2, 7, 33), f32), (fnet_transformers, (3, 12, 20), f32),
                                               (fnet, (2, 5, 9), f64)])
def test_fnet_mixing(fn, shape, dtype):
    compare(fn, randn(*shape, dtype=dtype))


@pytest.mark.parametrize("fn", [fnet, fnet_transformers])
def test_fnet_non_contiguous_input(fn):
    compare(fn, randn(2, 33, 7).transpose(1, 2))


def test_transformers_fnet_model(monkeypatch):
    """transformers' FNetModel (its Fourier mixing as transformers writes it), whole, fullgraph.
    (Its other operators' CUDA programs are NVRTC-checked by their own tests, the FFT's above.)"""
    transformers = pytest.importorskip("transformers")
    monkeypatch.delenv("KILN_NVRTC_CHECK", raising=False)
    config = transformers.FNetConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                     max_position_embeddings=64, use_tpu_fourier_optimizations=False)
    model = transformers.FNetModel(config).eval()
    ids = torch.randint(0, 100, (2, 17))
    with torch.no_grad():
        expected = model(ids).last_hidden_state
        actual = torch.compile(model, backend="kiln", fullgraph=True)(ids).last_hidden_state
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


# long convolution ------------------------------------------------------------------------------

def long_convolution(u, k):
    length = u.shape[-1]
    n = 2 * length
    return torch.fft.irfft(torch.fft.rfft(u, n=n) * torch.fft.rfft(k, n=n), n=n)[..., :length]


@pytest.mark.parametrize("length", [7, 33, 100])
def test_long_convolution(length):
    compare(long_convolution, randn(2, 3, length), randn(3, length))


def test_long_convolution_is_a_convolution():
    """The values also agree with a direct causal convolution (not only with eager's FFT)."""
    u, k = randn(1, 1, 33), randn(1, 33)
    direct = torch.nn.functional.conv1d(torch.nn.functional.pad(u, (32, 0)), k.flip(-1)[None])
    got = torch.compile(long_convolution, backend="kiln", fullgraph=True)(u, k)
    torch.testing.assert_close(got, direct, atol=1e-4, rtol=1e-4)


# spectrograms ----------------------------------------------------------------------------------

def _spectrogram(n_fft, hop, win_length=None, out="abs", **kwargs):
    def fn(x):
        window = torch.hann_window(win_length or n_fft)
        spec = torch.stft(x, n_fft, hop, win_length=win_length, window=window, return_complex=True, **kwargs)
        return {"abs": lambda: spec.abs(), "power": lambda: spec.abs() ** 2,
                "real": lambda: torch.view_as_real(spec)}[out]()
    return fn


@pytest.mark.parametrize("n_fft, hop, win_length, out, kwargs, shape", [
    (64, 16, None, "abs", {}, (2, 400)),
    (50, 12, 40, "power", {}, (333,)),                       # window shorter than n_fft, 1-D signal
    (33, 8, None, "real", {"normalized": True}, (2, 101)),
    (16, 5, None, "abs", {"center": False, "onesided": False}, (3, 77)),
    (32, 8, None, "real", {"pad_mode": "constant"}, (1, 100)),
])
def test_stft(n_fft, hop, win_length, out, kwargs, shape):
    compare(_spectrogram(n_fft, hop, win_length, out, **kwargs), randn(*shape))


def test_stft_non_contiguous_float64():
    compare(_spectrogram(20, 5, out="real"), randn(90, 2, dtype=f64).t())


# norm=, n=, s=, dim= ----------------------------------------------------------------------------

@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
def test_one_dim_transforms(norm):
    def fn(x):
        z = torch.fft.fft(x, n=10, dim=1, norm=norm)                # real input, truncated
        return (torch.fft.rfft(x, n=50, norm=norm),                 # zero padded, odd n
                torch.fft.ifft(z, n=13, dim=1, norm=norm),          # complex input, padded
                torch.fft.irfft(torch.fft.rfft(x, norm=norm), n=30, norm=norm),   # truncated bins
                torch.fft.irfft(torch.fft.rfft(x, dim=0, norm=norm), dim=0, norm=norm),
                torch.fft.hfft(z, n=9, norm=norm), torch.fft.ihfft(x, norm=norm),
                torch.fft.fftshift(z, dim=1), torch.fft.ifftshift(x), torch.fft.rfftfreq(33) * x[0, :17])
    compare(fn, randn(6, 33))


@pytest.mark.parametrize("norm", ["backward", "forward"])
def test_multi_dim_transforms(norm):
    def fn(x):
        return (torch.fft.fft2(x, norm=norm), torch.fft.fftn(x, s=(5, 4), norm=norm),
                torch.fft.ifftn(x, dim=(0, 2), norm=norm), torch.fft.rfft2(x, s=(6, 9), norm=norm),
                torch.fft.irfft2(torch.fft.rfft2(x, norm=norm), s=(7, 11), norm=norm),
                torch.fft.irfftn(torch.fft.rfftn(x, dim=(0, 1), norm=norm), dim=(0, 1), norm=norm),
                torch.fft.ifft2(torch.fft.fftn(x, dim=(1, 0), norm=norm), norm=norm))
    compare(fn, randn(3, 7, 10))


def test_dynamic_lengths():
    """A graph traced with symbolic sizes (dynamic=True) runs at each length with its own basis."""
    compiled = torch.compile(long_convolution, backend="kiln", dynamic=True)
    for length in (9, 12, 20):
        u, k = randn(2, length), randn(length)
        torch.testing.assert_close(compiled(u, k), long_convolution(u, k), atol=1e-4, rtol=1e-4)


def test_integer_input_is_transformed_as_float32():
    compare(lambda x: torch.fft.rfft(x), torch.randint(-5, 5, (3, 8)))


# complex intermediates ---------------------------------------------------------------------------

def test_complex_element_wise():
    def fn(x, y):
        z, w = torch.fft.rfft(x), torch.fft.rfft(y)
        return ((z * w + z - w).real, (z.conj() * w).imag, (z / w).abs(), (z * 2.5 - 1).angle(),
                torch.view_as_real(2 - z), torch.view_as_real(-z * 1j + y[..., :5]),
                (z * y[..., :5]).real, (1 / z).imag, torch.view_as_real(torch.fft.ifft(w * z.conj())),
                torch.real(z + torch.complex(y[..., :5], x[..., :5])), torch.imag(z - 0.5j),
                torch.view_as_real(y * 1j + 2j - x / (1 + 1j)))
    compare(fn, randn(4, 8), randn(4, 8))


@pytest.mark.parametrize("dtype", [f32, f64])
def test_view_as_complex_and_back(dtype):
    def fn(x):
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return (torch.view_as_real(z * z.conj().resolve_conj() / (z + 3j)).flatten(-2), z.abs() ** 2,
                torch.fft.irfft(z, n=7))
    compare(fn, randn(3, 10, dtype=dtype))


def test_rotary_embedding_in_complex_numbers():
    """LLaMA's original rotary embedding: polar, view_as_complex, a broadcast product."""
    def rope(q, angles):
        freqs = torch.polar(torch.ones_like(angles), angles)                     # (seq, dim/2)
        z = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))     # (b, seq, h, dim/2)
        z = z * freqs.view(1, q.shape[1], 1, -1)
        return torch.view_as_real(z).flatten(3).type_as(q)
    compare(rope, randn(2, 5, 3, 8), randn(5, 4))


def test_shape_changes_of_complex_values():
    def fn(x):
        z = torch.fft.fft(x)                                       # (2, 3, 6)
        moved = z.permute(2, 0, 1).transpose(0, 1).reshape(2, -1)  # (2, 18)
        picked = z[:, 1:, ::2].unsqueeze(0).flatten(1, 2)           # (1, 4, 3)
        return torch.view_as_real(moved), picked.real, z[..., 0].imag
    compare(fn, randn(2, 3, 6))


# errors and fallback ---------------------------------------------------------------------------

def test_a_complex_output_names_the_node_and_what_is_supported():
    fn = torch.compile(lambda x: torch.fft.rfft(x) * 2, backend="kiln")
    with pytest.raises(Exception, match=r"(?s)graph output %mul.*complex64\[3, 5\].*real tensors only.*view_as_real"):
        fn(randn(3, 8))


def test_a_complex_input_names_its_readers_and_what_is_supported():
    fn = torch.compile(lambda z: torch.fft.ifft(z).real, backend="kiln")
    with pytest.raises(Exception, match=r"(?s)graph input .*fft_ifft.*complex64\[3, 8\].*real tensors only"):
        fn(torch.randn(3, 8, dtype=torch.complex64))


def test_an_unsupported_complex_operator_is_named():
    fn = torch.compile(lambda x: torch.exp(torch.fft.rfft(x)).real, backend="kiln")
    with pytest.raises(Exception, match=r"(?s)no Kiln rule for %exp.*complex64\[3, 5\]"):
        fn(randn(3, 8))


def test_a_transform_too_long_for_a_basis_matrix_says_so():
    fn = torch.compile(lambda x: torch.fft.fft(x).abs(), backend="kiln")
    with pytest.raises(Exception, match=r"fft: a transform of length 8193 .*matrix products"):
        fn(randn(8193))


def test_fallback_runs_complex_outputs_and_unsupported_operators_in_pytorch():
    def fn(x):
        z = torch.fft.rfft(x)
        return z * 2, torch.exp(z).real + 1, (z * z).abs()

    dynamo_config.fallback_to_eager(True)
    try:
        x = randn(3, 8)
        with pytest.warns(UserWarning, match=r"(?s)z: its complex value.*exp"):
            got = torch.compile(fn, backend="kiln")(x)
    finally:
        dynamo_config.reset()
    for a, b in zip(got, fn(x)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# the transform's product ----------------------------------------------------------------------

def test_the_dft_runs_on_the_matmul_template_and_is_never_tf32():
    from kiln.schedule import CompileSession
    x = kiln.symbol([8, 33])
    basis = kiln.from_torch(torch.randn(33, 34))
    graph = kiln.graph.optimize(kiln.trace_from(kiln.ops.dft(x, basis), [x]))
    assert CompileSession(kiln.device("cpu")).template(graph.nodes[0].task).name == "gemm_cpu"
    assert not kiln.ops.dft.traits.tf32 and kiln.ops.matmul.traits.tf32
    with pytest.raises(kiln.graph.OperatorError, match="dft: expected x"):
        kiln.ops.dft(kiln.from_torch(torch.randn(2, 5)), basis)


def test_the_tf32_permission_leaves_the_dft_exact():
    """On a CUDA graph where torch allows TF32 matmuls, the matmul gets `allow_tf32` and the
    transform's product does not (planned without a GPU)."""
    from kiln.passes.tf32 import AllowTF32
    x, basis = kiln.symbol([8, 33], device="cuda"), kiln.symbol([33, 34], device="cuda")
    graph = kiln.trace_from([kiln.ops.dft(x, basis), kiln.ops.matmul(x, basis)], [x, basis])
    with kiln.PassContext(config={"allow_tf32": True}):
        marked = AllowTF32()(graph)
    assert [(n.definition.name, bool(n.attrs.get("allow_tf32"))) for n in marked.nodes] == [
        ("dft", False), ("matmul", True)]


# on a GPU --------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("case", ["fnet", "long_convolution", "stft"])
def test_on_cuda_with_tf32_allowed(case):
    """With TF32 allowed for matmuls, the transforms still match eager's (never TF32) FFTs."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        if case == "fnet":
            compare(fnet, randn(2, 33, 64, device="cuda"))
        elif case == "long_convolution":
            compare(long_convolution, randn(2, 3, 100, device="cuda"), randn(3, 100, device="cuda"))
        else:
            def fn(x):
                return torch.stft(x, 64, 16, window=torch.hann_window(64, device=x.device),
                                  return_complex=True).abs()
            compare(fn, randn(2, 1000, device="cuda"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


# training (AOTAutograd's ATen graphs) ----------------------------------------------------------

def _train(fn, x, weight):
    out = torch.compile(fn, backend="kiln")(x, weight)
    out.square().sum().backward()
    grad, weight.grad = weight.grad, None
    expected = fn(x, weight)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grad, weight.grad, atol=1e-4, rtol=1e-4)


def test_fnet_trains_in_kiln():
    """FNet's forward and backward graphs (`_fft_c2c` both ways) compile whole: no fallback."""
    def fn(x, weight):
        return torch.tanh(fnet(x @ weight))
    _train(fn, randn(2, 7, 6), randn(6, 6).requires_grad_())


def test_long_convolution_trains_with_its_saved_spectra_in_pytorch():
    """The forward saves complex spectra for the backward: a complex graph output, an error
    that says so, or under fallback_to_eager PyTorch computes them and Kiln the rest."""
    def fn(u, k):
        return torch.tanh(long_convolution(u, k))
    u, k = randn(2, 3, 9), randn(3, 9).requires_grad_()
    with pytest.raises(Exception, match=r"(?s)graph output .*complex64.*real tensors only"):
        torch.compile(fn, backend="kiln")(u, k)
    torch._dynamo.reset()
    dynamo_config.fallback_to_eager(True)
    try:
        with pytest.warns(UserWarning, match=r"_fft_r2c: its complex value is read outside Kiln"):
            _train(fn, u, k)
    finally:
        dynamo_config.reset()

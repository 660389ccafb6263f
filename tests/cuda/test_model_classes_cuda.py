"""The model classes of issue 30 on a GPU: small configurations of the transformers, timm and
torchvision models that crashed, ran wrong or fell back to PyTorch on CUDA, and PyTorch's own
recurrent and transformer modules, each compiled whole (graph breaks allowed) and compared with
eager in float32 with TF32 off. Each has a CPU regression test of the construct that broke it;
this file checks the models as a user meets them, in float32 and in 16 bits."""
import copy

import pytest
import torch

from tests.support import cudnn_tf32

pytestmark = [pytest.mark.cuda, pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]

RELATIVE = 1e-4


def _tokens(vocab: int, length: int = 24, batch: int = 2):
    return {"input_ids": torch.randint(0, vocab, (batch, length), device="cuda")}


def _transformers(config_name: str, model_name: str, image: int | None = None, **config):
    """A transformers model of `config` and its inputs: token ids, or `image` x `image` pixels."""
    def build():
        transformers = pytest.importorskip("transformers")
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
        if image is not None:
            return model, {"pixel_values": torch.randn(2, 3, image, image, device="cuda")}
        return model, _tokens(config.get("vocab_size", 1000))
    return build


def _timm(name: str, size: int, **kwargs):
    def build():
        timm = pytest.importorskip("timm")
        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        return model, {"x": torch.randn(2, 3, size, size, device="cuda")}
    return build


def _recurrent(make, *shape):
    return lambda: (make(), {"input": torch.randn(*shape, device="cuda")})


def _wav2vec2():
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                         num_conv_pos_embedding_groups=4, feat_extract_norm="group")
    return transformers.Wav2Vec2Model(config), {"input_values": torch.randn(2, 4000, device="cuda")}


def _raft():
    optical_flow = pytest.importorskip("torchvision.models.optical_flow")
    images = {f"image{k}": torch.randn(1, 3, 128, 160, device="cuda") for k in (1, 2)}
    return optical_flow.raft_small(weights=None), {**images, "num_flow_updates": 4}


class _Heads(torch.nn.Module):
    """A detection model's backbone and head on a batch of images (what follows, the boxes'
    selection, compares badly between two runs of random weights: near-equal scores)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images):
        features = list(self.model.backbone(images).values())
        return self.model.head(features)


def _ssdlite():
    detection = pytest.importorskip("torchvision.models.detection")
    model = detection.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=10)
    return _Heads(model), {"images": torch.randn(2, 3, 320, 320, device="cuda")}


def _mvit_v2():
    video = pytest.importorskip("torchvision.models.video")
    return video.mvit_v2_s(weights=None, num_classes=10), {"x": torch.randn(1, 3, 16, 224, 224, device="cuda")}


SMALL_TEXT = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128)

MODELS = {
    "mistral": _transformers("MistralConfig", "MistralModel", num_key_value_heads=2, sliding_window=8,
                             **SMALL_TEXT),
    "gemma2": _transformers("Gemma2Config", "Gemma2Model", num_key_value_heads=2, head_dim=16,
                            sliding_window=8, **SMALL_TEXT),
    "deberta_v2": _transformers("DebertaV2Config", "DebertaV2Model", **SMALL_TEXT),
    "xlnet": _transformers("XLNetConfig", "XLNetModel", vocab_size=1000, d_model=64, n_layer=2, n_head=4,
                           d_inner=128),
    "mpnet": _transformers("MPNetConfig", "MPNetModel", **SMALL_TEXT),
    "funnel": _transformers("FunnelConfig", "FunnelModel", vocab_size=1000, block_sizes=[1, 1], d_model=64,
                            n_head=4, d_head=16, d_inner=128),
    # a stage whose channel count equals its spatial size (the silent wrong answer of issue 30)
    "convnext_v2": _transformers("ConvNextV2Config", "ConvNextV2Model", image=64, hidden_sizes=[16, 32, 64, 96],
                                 depths=[1, 1, 2, 1]),
    "segformer": _transformers("SegformerConfig", "SegformerModel", image=64, hidden_sizes=[16, 32, 64, 96],
                               depths=[1, 1, 1, 1], num_attention_heads=[1, 2, 2, 4]),
    "coat_lite_tiny": _timm("coat_lite_tiny", 224),
    "xcit_nano": _timm("xcit_nano_12_p16_224", 224),
    "twins_svt_small": _timm("twins_svt_small", 224),
    "edgenext_xx_small": _timm("edgenext_xx_small", 256),
    "ghostnetv2": _timm("ghostnetv2_100", 224),
    "nn_transformer": lambda: (torch.nn.Transformer(64, 4, 2, 2, 128, batch_first=True),
                               {"src": torch.randn(2, 11, 64, device="cuda"),
                                "tgt": torch.randn(2, 7, 64, device="cuda"),
                                "tgt_mask": torch.nn.Transformer.generate_square_subsequent_mask(7, device="cuda")}),
    # mixture of experts: transformers' grouped matmul and torch.histc
    "deepseek_v3": _transformers("DeepseekV3Config", "DeepseekV3Model", vocab_size=1000, hidden_size=64,
                                 intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                 kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                 v_head_dim=16, n_group=1, topk_group=1),
    "wav2vec2": _wav2vec2,                  # group norm of the feature extractor
    "raft_small": _raft,
    "ssdlite": _ssdlite,
    "mvit_v2_s": _mvit_v2,
    # Fourier token mixing (torch.fft through Kiln's dft)
    "fnet": _transformers("FNetConfig", "FNetModel", vocab_size=1000, hidden_size=32, num_hidden_layers=2,
                          intermediate_size=64, max_position_embeddings=64),
    "lstm": _recurrent(lambda: torch.nn.LSTM(32, 48, num_layers=2, batch_first=True), 3, 13, 32),
    "gru": _recurrent(lambda: torch.nn.GRU(32, 48, num_layers=2, batch_first=True), 3, 13, 32),
}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@pytest.mark.parametrize("name", list(MODELS))
def test_model_class_matches_eager(name, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)   # cuDNN's: the autouse fixture
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.cuda().eval()
    with torch.no_grad():
        want = _tensors(model(**inputs))
        got = _tensors(torch.compile(model, backend="kiln")(**inputs))
    assert len(got) == len(want) and want
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if w.is_floating_point():
            scale = w.abs().max().clamp_min(1e-6)
            error = ((g - w).abs().max() / scale).item()
            print(f"{name}: {list(w.shape)} relative error {error:.2e}")
            assert error <= RELATIVE, f"{name}: output {list(w.shape)} is {error:.2e} from eager's (relative)"
        else:
            assert torch.equal(g, w)


def _cast(value, dtype):
    """`value` (a tensor, or a dict / list of them, or anything else) with floating tensors in
    `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _errors(outputs, reference) -> list[float]:
    """Each floating output's largest difference from `reference`'s, relative to its scale."""
    errors = []
    for o, r in zip(outputs, reference):
        if r.is_floating_point():
            scale = r.abs().max().clamp_min(1e-6)
            errors.append(((o.double() - r).abs().max() / scale).item())
    return errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_class_in_16_bits_is_as_near_float64_as_eager(name, dtype):
    """The same models with 16-bit weights and inputs: against the model run in float64, Kiln's
    error is at most 3x eager's own (or the type's rounding step, where eager's is below it).
    Where torch has no float64 kernel for the model on CUDA (grid_sample's cuDNN kernel with a
    float32 grid, grouped_mm), the reference is float32 without TF32, which is still 2^13 times
    finer than the 16-bit types. A model whose eager 16-bit run raises (FFTs in bfloat16, which
    torch does not compute) is skipped with eager's error."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.cuda().eval()
    with torch.no_grad():
        try:
            reference = _tensors(copy.deepcopy(model).double()(**_cast(inputs, torch.float64)))
        except RuntimeError:
            with cudnn_tf32(False):
                reference = _tensors(copy.deepcopy(model)(**inputs))
        low, low_inputs = model.to(dtype), _cast(inputs, dtype)
        try:
            eager = _tensors(low(**low_inputs))
        except RuntimeError as error:
            pytest.skip(f"eager {dtype} raises: {error}")
        got = _tensors(torch.compile(low, backend="kiln")(**low_inputs))
    assert len(got) == len(eager) == len(reference) and reference
    step = torch.finfo(dtype).eps
    for k, (kiln_error, eager_error) in enumerate(zip(_errors(got, reference), _errors(eager, reference))):
        print(f"{name} {dtype}: output {k} Kiln {kiln_error:.2e}, eager {eager_error:.2e}")
        assert kiln_error <= 3 * max(eager_error, step), (
            f"{name} {dtype}: output {k} is {kiln_error:.2e} from float64's, eager {eager_error:.2e}")

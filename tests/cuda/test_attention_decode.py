"""The decode attention template (`attention_decode`) on a GPU against torch's
scaled_dot_product_attention in float64, each error at most twice eager's own (16-bit sdpa on
the same inputs) plus a little: issue 12's decode shape and smaller ones with every head dim,
grouped-query groups of 1 to 8, 1 to 16 queries, key counts that are no multiple of the tiles,
both 16-bit types, a bool key-padding mask, an additive float mask, causal, a sequence with no
keys (zeros), a [B, L, H, D] query read in place through torch.compile, and every level-1
knob setting. Until these tests and its timings have run on a GPU, the template ranks after
attention_flash (which Kiln therefore still chooses), so they run it by name."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.schedule import device_arch, schedules_for
from kiln_ops_builtin.templates import attention_decode
from kiln_ops_builtin.templates.attention_match import match_attention

from tests.cuda.attention_support import check_near_eager as _check, load_template, tensor_task as _task

from tests.frontend.frontend_support import Capture

pytestmark = pytest.mark.cuda

SHAPES = {  # batch, query heads, key/value heads, queries, keys, head dim
    "decode_gqa4": (8, 32, 8, 1, 4096, 128),
    "mha_3_queries": (2, 8, 8, 3, 1000, 64),
    "gqa3_odd_keys": (3, 12, 4, 1, 777, 80),
    "gqa8_16_queries": (1, 16, 2, 16, 2049, 96),
}
VARIANTS = ("plain", "bool_padding", "float_mask", "causal")


def _randn(*shape, dtype):
    return torch.randn(shape, device="cuda", dtype=torch.float32).to(dtype)


def _inputs(shape, dtype, variant):
    """q, k, v, mask and causality of a case; a padding mask keeps each sequence's first key, so
    that eager (NaN for a row without keys) stays comparable."""
    b, hq, hkv, lq, lk, d = shape
    q, k, v = _randn(b, hq, lq, d, dtype=dtype), _randn(b, hkv, lk, d, dtype=dtype), _randn(b, hkv, lk, d, dtype=dtype)
    mask = None
    if variant == "bool_padding":
        mask = torch.rand(b, 1, 1, lk, device="cuda") > 0.3
        mask[..., 0] = True
    elif variant == "float_mask":
        mask = _randn(b, hq, lq, lk, dtype=dtype)
    return q, k, v, mask, variant == "causal"


def _run_op(q, k, v, mask=None, causal=False):
    task = _task(q, k, v, mask, causal)
    assert "attention_decode" in [t.name for t in schedules_for(task, "cuda", device_arch(kiln.device("cuda")))]
    knobs = attention_decode.suggest(task, torch.cuda.get_device_properties(0).multi_processor_count)[0]
    return load_template(attention_decode, task, knobs)([q, k, v] + ([mask] if mask is not None else []))


CASES = [pytest.param(s, v, id=f"{s}-{v}") for s in SHAPES for v in VARIANTS if v != "causal" or SHAPES[s][3] > 1]


@pytest.mark.parametrize("shape,variant", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_matches_sdpa(shape, variant, dtype):
    torch.manual_seed(0)
    q, k, v, mask, causal = _inputs(SHAPES[shape], dtype, variant)
    _check(_run_op(q, k, v, mask, causal), q, k, v, mask, causal)


def test_sequence_without_keys_gives_zeros():
    q, k, v, mask, _ = _inputs((3, 8, 2, 2, 1100, 64), torch.float16, "bool_padding")
    mask[2] = False
    out = _run_op(q, k, v, mask)
    assert (out[2] == 0).all()
    _check(out[:2], q[:2], k[:2], v[:2], mask[:2])


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_blhd_query_read_in_place(shape, dtype):
    """torch.compile of sdpa on q given as [B, L, H, D] transposed to [B, H, L, D]: the view
    fuses into the attention task, which this template reads at q's strides."""
    b, hq, hkv, lq, lk, d = SHAPES[shape]
    q_blhd = _randn(b, lq, hq, d, dtype=dtype)
    k, v = _randn(b, hkv, lk, d, dtype=dtype), _randn(b, hkv, lk, d, dtype=dtype)

    def attend(q_blhd, k, v):
        return F.scaled_dot_product_attention(q_blhd.transpose(1, 2), k, v, enable_gqa=True)

    capture = Capture()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(attend, backend=capture, fullgraph=True)(q_blhd, k, v)
    assert capture.compiled, "the Kiln backend was never called"
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    nodes = [n for n in graph.nodes if n.name != "Constant"]
    assert len(nodes) == 1 and nodes[0].task.name == "attention", [n.name for n in nodes]      # the view fused
    task = nodes[0].task
    assert attention_decode.applies(task)
    if lq > 1:
        assert match_attention(task).q.row_stride == hq * d
    _check(out, q_blhd.transpose(1, 2), k, v)
    knobs = attention_decode.suggest(task, torch.cuda.get_device_properties(0).multi_processor_count)[0]
    _check(load_template(attention_decode, task, knobs)([q_blhd, k, v]), q_blhd.transpose(1, 2), k, v)




@pytest.mark.parametrize("knobs", attention_decode.TEMPLATE.space(1), ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("shape,variant,dtype", [("decode_gqa4", "bool_padding", torch.float16),
                                                 ("gqa8_16_queries", "float_mask", torch.bfloat16),
                                                 ("mha_3_queries", "causal", torch.float16)])
def test_every_level1_knob(knobs, shape, variant, dtype):
    q, k, v, mask, causal = _inputs(SHAPES[shape], dtype, variant)
    task = _task(q, k, v, mask, causal)
    out = load_template(attention_decode, task, knobs)([q, k, v] + ([mask] if mask is not None else []))
    _check(out, q, k, v, mask, causal)

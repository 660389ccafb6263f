"""The decode attention template (`attention_decode`) without a GPU: which attention tasks it
takes (and that it ranks after `attention_flash` for them, and is absent for long queries), a
transposed query view fused in and read in place, its level-0 choices (rows packed per
key/value head, keys split to fill the GPU), its programs (the split-KV partials in
`attention_flash`'s layout), and every knob setting compiled with NVRTC for sm_80 and sm_90
(each head dim, both 16-bit types, bool and float masks, causal, grouped-query heads, a strided
query view). The operator on the CPU under KILN_NVRTC_CHECK with a decode shape is in
test_attention_flash_nvrtc.py."""
import pytest

import kiln
from kiln import dtypes
from kiln.ir import Task, TensorInput, compute
from kiln.runtime import cuda as rt
from kiln.schedule import schedules_for
from kiln_ops_builtin import attention as attention_op
from kiln_ops_builtin.templates import attention_decode, attention_flash
from kiln_ops_builtin.templates.attention_match import match_attention

from tests.cuda.attention_support import attention_task

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")
f16, bf16 = dtypes.float16, dtypes.bfloat16
DECODE = ((8, 32, 1, 128), (8, 8, 4096, 128))          # issue 12's decode shape: q, k and v


def _task(q=DECODE[0], k=DECODE[1], *args, **kwargs):
    return attention_task(q, k, *args, **kwargs)


def _blhd_task(b, lq, hq, hkv, lk, d, dtype=f16):
    """Attention whose q is read from a [B, L, H, D] input through a transposing view."""
    src = TensorInput("q", (b, lq, hq, d), dtype)
    k, v = TensorInput("k", (b, hkv, lk, d), dtype), TensorInput("v", (b, hkv, lk, d), dtype)
    q = compute((b, hq, lq, d), lambda i, h, s, e: src[i, s, h, e])
    return Task("attention", [src, k, v], [attention_op.attention.definition(q, k, v, None, None, False)], {})


def test_takes_few_queries_against_many_keys():
    for d in attention_decode.HEAD_DIMS:
        for t in (f16, bf16):
            assert attention_decode.applies(_task((2, 8, 3, d), (2, 2, 1000, d), dtype=t))
    assert attention_decode.applies(_task((1, 16, 16, 96), (1, 2, 256, 96), causal=True))
    assert attention_decode.applies(_blhd_task(2, 3, 8, 8, 1000, 64))
    assert not attention_decode.applies(_task((1, 16, 17, 96), (1, 2, 2049, 96)))          # 17 queries
    assert not attention_decode.applies(_task((1, 16, 16, 96), (1, 2, 255, 96)))           # 255 keys
    assert not attention_decode.applies(_task(dtype=dtypes.float32))
    assert not attention_decode.applies(_task((2, 4, 1, 48), (2, 2, 1000, 48)))
    assert not attention_decode.applies(_task((2, 4, 1, 64), (2, 2, 1000, 64), (2, 2, 1000, 128)))   # Dv != D


def test_ranked_before_flash_for_decoding_only():
    """Ranked before attention_flash where both apply (faster on an H100: benchmarks/HISTORY.md);
    prefill goes to attention_sm90 (before flash) beyond one key tile, short caches stay with flash."""
    names = lambda task: [t.name for t in schedules_for(task, "cuda", 90)]
    assert names(_task()) == ["attention_decode", "attention_flash"]
    assert names(_task((3, 12, 1, 80), (3, 4, 777, 80), mask=((3, 1, 1, 777), dtypes.boolean)))[0] == \
        "attention_decode"
    assert names(_task((4, 32, 4096, 128), (4, 8, 4096, 128), causal=True)) == ["attention_sm90", "attention_flash"]
    assert names(_task((8, 12, 128, 64), (8, 12, 128, 64))) == ["attention_flash"]                # one key tile
    assert names(_task((8, 32, 1, 128), (8, 8, 128, 128))) == ["attention_flash"]            # few keys


@pytest.mark.parametrize("b,hq,hkv,lq,lk,d", [(8, 32, 8, 1, 4096, 128), (1, 16, 2, 16, 2049, 96)])
def test_transposed_query_view_fuses_into_decode(b, hq, hkv, lq, lk, d):
    """A graph on CUDA symbols (planned without a GPU): q given as [B, L, H, D] and transposed
    to [B, H, L, D] is read in place by the one attention kernel, which this template takes."""
    q = kiln.symbol([b, lq, hq, d], "float16", device="cuda")
    k, v = (kiln.symbol([b, hkv, lk, d], "float16", device="cuda") for _ in "kv")
    graph = kiln.graph.optimize(kiln.trace_from(kiln.ops.attention(kiln.ops.transpose(q, 1, 2), k, v)))
    nodes = [n for n in graph.nodes if n.name != "Constant"]
    assert len(nodes) == 1 and nodes[0].task.name == "attention"
    assert attention_decode.applies(nodes[0].task)
    if lq > 1:
        assert match_attention(nodes[0].task).q.row_stride == hq * d


def test_level0_choice():
    # 64 (batch, key/value head) CTAs of 4 rows, two a multiprocessor: 4 shares
    knobs = attention_decode.suggest(_task(), 132)[0]
    assert knobs == {"BN": 16, "NW": 4, "MT": 1, "WR": 1, "SPLIT": 4}
    assert attention_decode.render(_task(), **knobs).launches[0].grid == (8 * 8 * 4, 1, 1)
    # 8 heads x 16 queries = 128 rows of one key/value head: four row warps of 32, one key warp
    assert attention_decode.suggest(_task((1, 16, 16, 96), (1, 2, 2049, 96)), 132)[0] == \
        {"BN": 64, "NW": 4, "MT": 2, "WR": 4, "SPLIT": 11}
    assert attention_decode.suggest(_task((2, 8, 3, 64), (2, 8, 1000, 64)), 132)[0]["MT"] == 1
    # causal: the queries see their first keys only, one tile, no split
    assert attention_decode.suggest(_task((1, 16, 16, 96), (1, 2, 2049, 96), causal=True), 132)[0]["SPLIT"] == 1
    for task in (_task(), _task((3, 12, 1, 80), (3, 4, 777, 80))):
        assert attention_decode.DecodeKnobs(**attention_decode.suggest(task, 132)[0]).valid()


def test_split_kv_program_combines_partials_as_flash_does():
    program = attention_decode.render(_task((2, 8, 3, 64), (2, 2, 1000, 64)), BN=16, NW=4, MT=1, WR=1, SPLIT=4)
    assert [launch.kernel for launch in program.launches] == ["kiln_attention_decode", "kiln_attention_combine"]
    assert program.launches[0].grid == (4 * 2 * 2, 1, 1)          # splits x batch x key/value heads
    assert program.temporaries == [((4, 16, 3, 64), dtypes.float32), ((4, 16, 3, 2), dtypes.float32)]
    assert "kiln_attention_combine(" in program.source
    single = attention_decode.render(_task((2, 8, 3, 64), (2, 2, 1000, 64)), BN=16, NW=4, MT=1, WR=1, SPLIT=1)
    assert [launch.kernel for launch in single.launches] == ["kiln_attention_decode"] and not single.temporaries


def test_space_is_valid():
    for level in (0, 1, 2):
        for knobs in attention_decode.TEMPLATE.space(level):
            assert attention_decode.DecodeKnobs(**knobs).smem_bytes(128) <= attention_decode.MAX_SMEM, knobs
    assert attention_decode.TEMPLATE.space(0) == [attention_decode.DecodeKnobs().as_dict()]
    with pytest.raises(ValueError, match="DecodeKnobs: unsupported setting"):
        attention_decode.DecodeKnobs(WR=3)                                      # 4 warps in 3 rows
    with pytest.raises(ValueError, match="DecodeKnobs: unsupported setting"):
        attention_decode.DecodeKnobs(BN=128, NW=8)                              # 1024 keys a tile
    with pytest.raises(ValueError, match="DecodeKnobs: unsupported setting"):
        attention_decode.render(_task(), BN=24, NW=4, MT=1, WR=1)


TASKS = {
    "d128_gqa4_decode": dict(),
    "d64_bool_padding_causal": dict(q=(2, 8, 3, 64), k=(2, 8, 1000, 64), mask=((2, 1, 1, 1000), dtypes.boolean),
                                    causal=True),
    "d80_bf16_float_mask_gqa3": dict(q=(3, 12, 1, 80), k=(3, 4, 777, 80), dtype=bf16,
                                     mask=((3, 12, 1, 777), bf16)),
    "d96_gqa8_16_queries": dict(q=(1, 16, 16, 96), k=(1, 2, 2049, 96), dtype=bf16, scale=0.3),
}


@needs_nvrtc
@pytest.mark.parametrize("name", list(TASKS))
def test_every_knob_compiles(name):
    task = _task(**TASKS[name])
    knobs = attention_decode.TEMPLATE.space(2) + attention_decode.suggest(task, 132)[:1]
    programs = [attention_decode.render(task, **k) for k in knobs]
    rt.compile_many([(p.source, f"attention_decode_{name}", arch) for p in programs for arch in ("sm_80", "sm_90")])


@needs_nvrtc
def test_other_layouts_compile():
    """A strided query view, heads without leading dims, no heads at all: level 0 and the suggestion."""
    tasks = [_blhd_task(1, 16, 16, 2, 2049, 96), _task((8, 2, 128), (2, 300, 128), dtype=bf16),
             _task((4, 64), (1000, 64))]
    programs = [attention_decode.render(task, **k) for task in tasks
                for k in attention_decode.TEMPLATE.space(0) + attention_decode.suggest(task, 132)[:1]]
    rt.compile_many([(p.source, "attention_decode_layouts", arch) for p in programs for arch in ("sm_80", "sm_90")])

"""The float32 attention template (`attention_simt`) without a GPU: it takes float32 attention
and leaves the 16-bit types to the tensor-core templates; every knob setting of its level-2
space compiles with NVRTC for sm_80 and sm_90 (head dims 32 to 128, causal, bool and float
masks, a scale, grouped-query heads, lengths that are no multiple of the tiles, [B, L, H, D]
views, a fused epilogue); the lengths of a symbolic bucket share one source; a float32 BERT's
attention plans onto it."""
import dataclasses

import pytest

from kiln import dtypes
from kiln.runtime import cuda as rt
from kiln.schedule import schedules_for
from kiln_ops_builtin.templates import attention_simt

from tests.cuda.attention_support import attention_task, blhd_task
from tests.cuda.symbolic_cases import CASES as SYMBOLIC

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")
f32 = dtypes.float32


def _task(q=(2, 4, 70, 64), k=(2, 2, 75, 64), *args, dtype=f32, **kwargs):
    return attention_task(q, k, *args, dtype=dtype, **kwargs)


def test_takes_float32_and_leaves_16_bit_to_the_tensor_core_templates():
    for d in (32, 64, 80, 96, 128):
        assert attention_simt.applies(_task((2, 4, 70, d), (2, 2, 75, d)))
    assert attention_simt.applies(_task((1, 4, 1, 64), (1, 4, 4096, 64)))                  # decoding too
    assert not attention_simt.applies(_task(dtype=dtypes.float16))
    assert not attention_simt.applies(_task((2, 4, 70, 160), (2, 2, 75, 160)))             # past MAX_D
    assert not attention_simt.applies(_task((2, 4, 70, 63), (2, 2, 75, 63)))               # an odd head dim
    assert not attention_simt.applies(_task((2, 4, 70, 64), (2, 2, 75, 64), (2, 2, 75, 128)))   # Dv != D
    task = _task((1, 12, 128, 64), (1, 12, 128, 64))
    assert [t.name for t in schedules_for(task, "cuda", 90)] == ["attention_simt"]
    assert [t.name for t in schedules_for(_task(dtype=dtypes.float16), "cuda", 90)][0] != "attention_simt"


def test_invalid_knobs_raise():
    with pytest.raises(ValueError, match="AttentionSimtKnobs: unsupported setting"):
        attention_simt.render(_task(), NW=3, R=4)


CASES = [dict(), dict(causal=True), dict(mask=((70, 75), dtypes.boolean)), dict(mask=((2, 1, 70, 75), f32), scale=0.3),
         dict(causal=True, mask=((70, 75), dtypes.boolean))]


@needs_nvrtc
def test_every_knob_compiles():
    jobs = []
    for knobs in attention_simt.TEMPLATE.space(2):
        for d in (32, 64, 80, 128):
            for case in CASES:
                program = attention_simt.render(_task((2, 4, 70, d), (2, 2, 75, d), **case), **knobs)
                jobs += [(program.source, f"simt{len(jobs)}_{arch}", arch) for arch in ("sm_80", "sm_90")]
    blhd = attention_simt.render(blhd_task(2, 150, 8, 2, 96, f32, True), **attention_simt.TEMPLATE.space(0)[0])
    jobs.append((blhd.source, "simt_blhd", "sm_90"))
    rt.compile_many(jobs)


@needs_nvrtc
def test_the_lengths_of_a_bucket_share_one_source():
    case = dataclasses.replace(next(c for c in SYMBOLIC if c.name == "attention_prefill"), dtype="float32")
    programs = []
    for n in (70, 100, 128):
        task = next(node.task for node in case.graph(n).nodes if attention_simt.applies(node.task))
        programs.append(attention_simt.render(task, **attention_simt.suggest(task, 132)[0]))
    assert len({p.source for p in programs}) == 1 and [p.sizes for p in programs] == [(70,), (100,), (128,)]
    rt.compile_many([(programs[0].source, "attention_simt_symbolic", "sm_90")])

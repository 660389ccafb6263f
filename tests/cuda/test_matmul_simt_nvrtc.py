"""The float32 SIMT GEMM template (`matmul_simt`) without a GPU: its knob settings, the
layout each operand is copied in, its level-0 choices, and every knob setting of level 2
compiled with NVRTC for sm_80 and sm_90 on the cases of `simt_cases`."""
import re
import pytest

import kiln
from kiln.graph import optimize, trace_from
from kiln.ir import SymSize
from kiln.tensor import symbol
from kiln.runtime import cuda as rt
from kiln.schedule.choose import schedules_for
from kiln_ops_builtin.templates import matmul_simt

from tests.cuda.simt_cases import CALLS, VIEWS, call_inputs, call_task, view_task
from tests.support import rand

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _copies(program) -> list:
    """The kinds of A and B in the program's kiln_matmul_simt_program: (KC, W, Async) of Plain,
    or "Hooked"."""
    kinds = re.findall(r"kiln::matmul_simt::(?:Plain<(\d), (\d), (\d)>|(Hooked))", program.source)
    return [k[3] or k[:3] for k in kinds]


def test_every_setting_is_a_valid_layout():
    for knobs in matmul_simt.TEMPLATE.space(2):
        tile = matmul_simt.thread_tile(knobs["BM"], knobs["BN"], knobs["WM"], knobs["WN"])
        assert tile is not None and tile[0] * tile[1] * 256 == knobs["BM"] * knobs["BN"]
        assert matmul_simt.smem_bytes(knobs["BM"], knobs["BN"], knobs["BK"], knobs["STAGES"]) <= matmul_simt.MAX_SMEM
    assert matmul_simt.thread_tile(128, 128, 64, 64) is None        # 4 warps
    task = call_task("square_tiles", call_inputs("square_tiles"))
    with pytest.raises(ValueError, match="warp tile 64x64"):
        matmul_simt.render(task, BM=128, BN=128, BK=8, WM=64, WN=64)
    with pytest.raises(ValueError, match="BM=128, BN=128, BK=16, STAGES=3 need 50688 bytes"):
        matmul_simt.render(task, **dict(matmul_simt.WIDE.as_dict(), BK=16, STAGES=3))
    with pytest.raises(ValueError, match="STAGES=1"):
        matmul_simt.SimtKnobs(STAGES=1)
    assert matmul_simt.TEMPLATE.space(0) == [matmul_simt.SimtKnobs().as_dict()]        # level 0: the defaults


@pytest.mark.parametrize("name,a,b", [                           # Plain's (KC, W, Async)
    ("square_tiles", ("1", "4", "0"), ("0", "4", "1")),          # A float4s along k; B along n, by cp.async
    ("odd_k_scalar_a", ("1", "1", "0"), ("0", "4", "1")),        # K = 33: A a scalar at a time
    ("odd_everything", ("1", "1", "0"), ("0", "1", "0")),
    ("linear_bias", ("1", "4", "0"), ("1", "4", "0")),           # both k-contiguous
])
def test_operand_copies(name, a, b):
    assert _copies(matmul_simt.render(call_task(name, call_inputs(name)), **matmul_simt.TEMPLATE.space(0)[0])) == [a, b]


def test_views_choose_their_copies():
    """A transposed A is m-contiguous (float4s by cp.async); a slice at an offset is read
    through the load hooks."""
    task, _ = view_task("transposed_a")
    assert _copies(matmul_simt.render(task, **matmul_simt.TEMPLATE.space(0)[0]))[0] == ("0", "4", "1")
    for name in ("slice_offset", "slice_odd_offset"):
        task, _ = view_task(name)
        assert schedules_for(task, "cuda", 90)[0].name == "matmul_simt"
        assert _copies(matmul_simt.render(task, **matmul_simt.TEMPLATE.space(0)[0])) == ["Hooked", "Hooked"]


def test_level0_choice():
    big = call_task("square_tiles", [rand((4096, 4096)), rand((4096, 4096))])
    first = matmul_simt.suggest(big, 132)[0]                                            # B by cp.async
    assert first == matmul_simt.TEMPLATE.space(0)[0]
    assert (first["BM"], first["BN"], first["MIN_BLOCKS"], first["FRAG"]) == (128, 256, 1, 1)
    linear = call_task("linear_bias", [rand((4096, 4096)), rand((4096, 4096)), rand((4096,))])
    staged = matmul_simt.suggest(linear, 132)[0]                                        # both through registers
    assert staged == dict(matmul_simt.TEMPLATE.space(1)[1], **matmul_simt.STAGED_PIPELINE)
    assert (staged["BM"], staged["BN"], staged["MIN_BLOCKS"]) == (128, 128, 2)          # two blocks an SM
    conv = call_task("conv_hooks", call_inputs("conv_hooks"))
    wide = [k for k in matmul_simt.suggest(conv, 132) if (k["BM"], k["BN"]) == (128, 128)]
    assert wide and all(k["MIN_BLOCKS"] == 1 for k in wide)                             # hooks would spill
    bert = call_task("linear_bias", [rand((128, 768)), rand((768, 768)), rand((768,))])
    assert matmul_simt.suggest(bert, 132)[0].get("SPLIT", 1) > 1            # 24 to 36 tiles for 132 SMs
    mid = call_task("linear_bias", [rand((1024, 768)), rand((768, 768)), rand((768,))])
    first = matmul_simt.suggest(mid, 132)[0]
    assert (first["BM"], first["BN"], first["SPLIT"]) == (64, 128, 4)      # 128 x 128 tiles are never split
    assert all(k.get("SPLIT", 1) == 1 for k in matmul_simt.suggest(mid, 132) if (k["BM"], k["BN"]) == (128, 128))


@needs_nvrtc
@pytest.mark.parametrize("name", list(CALLS) + list(VIEWS))
def test_every_setting_compiles(name):
    task = view_task(name)[0] if name in VIEWS else call_task(name, call_inputs(name))
    programs = [matmul_simt.render(task, **knobs) for knobs in matmul_simt.TEMPLATE.space(2)]
    rt.compile_many([(p.source, p.kernel_names[0], arch) for p in programs for arch in ("sm_80", "sm_90")])


S0 = SymSize.named("s0", 37)


@needs_nvrtc
@pytest.mark.parametrize("shapes,build,hooks", [
    ([(S0, 12), (S0, 20)], lambda x, w: kiln.ops.matmul(kiln.ops.permute(x, (1, 0)), w), False),  # K symbolic
    ([(S0, 12), (S0, 20)], lambda x, w: kiln.ops.matmul(w, kiln.ops.permute(w, (1, 0))), False),  # M and N
    ([(2, 5, S0, 9), (12, 5, 3, 3)], lambda x, w: kiln.ops.conv2d(x, w, None, 1, 1), True),       # M, load hooks
], ids=["k", "mn", "conv"])
def test_symbolic_sizes_compile(shapes, build, hooks):
    """Every setting of level 2 for tasks whose sizes are kernel arguments (`symbolic`)."""
    symbols = [symbol(list(s), "float32", "cuda") for s in shapes]
    (node,) = optimize(trace_from([build(*symbols)], symbols)).nodes
    programs = [matmul_simt.render(node.task, **knobs) for knobs in matmul_simt.TEMPLATE.space(2)]
    assert all(p.sizes == (37,) and (_copies(p) == ["Hooked"] * 2) == hooks for p in programs)
    rt.compile_many([(p.source, p.kernel_names[0], arch) for p in programs for arch in ("sm_80", "sm_90")])

"""CUDA templates that take symbolic sizes as kernel arguments (`Template.symbolic`), without a
GPU: a contraction or attention graph over a symbolic size renders one source at every size of
a bucket, its `sizes` carrying the value, and that source compiles with NVRTC (every knob
setting the tuner would try, too); a size the template cannot read goes to the next schedule;
fixed sizes keep sources without size parameters; a GPT-2-like block has one program source per
kernel for five sequence lengths. The GPU test (`test_symbolic_templates_cuda.py`) runs them."""
import pytest

import kiln
from kiln.graph import optimize, trace_from
from kiln.ir import SymSize
from kiln.ir.size_reads import recording
from kiln.runtime import cuda as rt
from kiln.schedule import tuner
from kiln.schedule.choose import choose, schedules_for
from kiln.tensor import symbol
from kiln_ops_builtin.templates import gemm_sm90, split_k

from tests.cuda.symbolic_cases import CASES, gpt_block

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")
ARCHS = ("sm_80", "sm_90")
CANDIDATES = ("linear_bias_gelu", "symbolic_k", "gemv_scores", "attention_prefill", "attention_decode", "linear_f32",
              "linear_sm80", "conv_batch", "conv_batch_sm80", "depthwise_batch")


def _programs(graph, arch: int = 90) -> list:
    """(the first template taking each node's task on a GPU of `arch` or None, the program
    `choose` renders)."""
    out = []
    for node in graph.nodes:
        found = schedules_for(node.task, "cuda", arch)
        out.append((found[0] if found else None, choose(node.task, "cuda", arch)))
    return out


def _compile(programs) -> None:
    rt.compile_many([(p.source, p.kernel_names[0], p.arch_for(arch)) for p in programs for arch in ARCHS
                     if p.min_arch <= rt.arch_number(arch)])


@needs_nvrtc
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_source_serves_every_size_and_compiles(case):
    chosen = {n: _programs(case.graph(n), case.arch) for n in case.shared}
    first = chosen[case.shared[0]]
    assert case.template in [t.name for t, _ in first if t is not None]
    for n, programs in chosen.items():
        assert [p.source for _, p in programs] == [p.source for _, p in first]
        assert all(p.sizes == (n,) for _, p in programs)
    _compile([p for _, p in first])


@needs_nvrtc
@pytest.mark.parametrize("case", [c for c in CASES if c.name in CANDIDATES], ids=lambda c: c.name)
def test_every_candidate_compiles_with_symbolic_sizes(case):
    """The level-1 space and suggestions of the case's template, rendered for a symbolic task
    (split-K and split-KV included), one case of each template (gemm_sm90's with a symbolic M
    and a symbolic K)."""
    task = next(node.task for node in case.graph(case.shared[1]).nodes
                if any(t.name == case.template for t in schedules_for(node.task, "cuda", case.arch)))
    template = next(t for t in schedules_for(task, "cuda", case.arch) if t.name == case.template)
    programs = [template.render(task, **knobs) for knobs in tuner.candidates(template, task, 132, 1)]
    assert all(p.sizes == (case.shared[1],) for p in programs)
    _compile(programs)


def test_odd_and_even_sizes_share_the_source_of_a_packed_epilogue():
    """A symbolic innermost output extent (the scores' keys) tests its parity at run time
    before the epilogue's packed store, instead of giving odd and even sizes two sources."""
    scores = next(c for c in CASES if c.name == "scores")
    (_, odd), = _programs(scores.graph(33))
    (_, even), = _programs(scores.graph(34))
    assert odd.source == even.source and "kiln_size0 % 2 == 0" in odd.source


def test_a_size_tma_cannot_read_goes_to_the_next_schedule():
    """K-major rows of 17 16-bit elements are no 16-byte multiple: gemm_sm90 declines at that
    size and the next schedule takes it, specialized to it or with the size as argument."""
    case = next(c for c in CASES if c.name == "symbolic_k")
    (template, program), = _programs(case.graph(17))
    assert template is None or template.name != "gemm_sm90"
    assert "tmA" not in program.source
    (template, _), = _programs(case.graph(24))
    assert template.name == "gemm_sm90"


def test_fixed_sizes_keep_sources_without_size_parameters():
    x, w = symbol((2, 9, 768), "float16", "cuda"), symbol((512, 768), "float16", "cuda")
    task = optimize(trace_from([kiln.ops.linear(x, w)], [x, w])).nodes[0].task
    program = gemm_sm90.render(task, **gemm_sm90.suggest(task, 132)[0])
    assert program.sizes == () and "kiln_size" not in program.source and "#define M 18\n" in program.source


def test_knob_choices_bucket_symbolic_sizes_by_powers_of_two():
    assert split_k.bucket(SymSize.named("s0", 33)) == 64 and split_k.bucket(SymSize.named("s0", 64)) == 64
    assert split_k.bucket(SymSize.named("s0", 1)) == 1 and split_k.bucket(33) == 33


LENGTHS = (9, 13, 21, 27, 33)


@needs_nvrtc
def test_a_gpt2_like_model_has_one_source_per_kernel_for_five_lengths():
    sources = {n: [(t.name if t else "auto", p.source) for t, p in _programs(gpt_block(n))] for n in LENGTHS}
    assert all(found == sources[LENGTHS[0]] for found in sources.values())
    names = [name for name, _ in sources[LENGTHS[0]]]
    assert "gemm_sm90" in names and "attention_flash" in names


@needs_nvrtc
def test_a_symbolic_row_count_keeps_the_packed_epilogue():
    """gemm_sm90 over a symbolic M packs its 16-bit outputs in registers (PACKED) as it does at
    a fixed M, reading no size's value: the output's row stride is fixed. It once fell back to
    staging accumulators wherever a size was symbolic, so a plan reused at a new length ran
    slower GEMMs than that length's own plan (GPT-2 on the H200)."""
    def program(length):
        x, w, b = symbol((1, length, 768), "float16", "cuda"), symbol((2304, 768), "float16", "cuda"), \
            symbol((2304,), "float16", "cuda")
        task = optimize(trace_from([kiln.ops.linear(x, w, b)], [x, w, b])).nodes[0].task
        return gemm_sm90.render(task, **gemm_sm90.suggest(task, 132)[0])

    with recording() as reads:
        symbolic = program(SymSize.named("s0", 128))
    assert reads.read is None and symbolic.sizes == (128,)
    for source in (symbolic.source, program(128).source):
        assert "PACKED = 1" in source and "out_at" in source
    _compile([symbolic])

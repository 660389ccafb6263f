"""Programmatic dependent launch without a GPU (`kiln.runtime.dependent_launch`): every kernel
of a source waits for the grids before it as its first statement, kernels that macros define
included, and the sources compile with NVRTC for sm_80 (the wait compiled out) and sm_90."""
import pytest
import torch

from kiln.plugins.registry import registry
from kiln.runtime import cuda as rt
from kiln.runtime import dependent_launch
from kiln_ops_builtin.templates import sort_bitonic

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")

MACRO_KERNELS = r'''
// a __global__ named in a comment, before the kernels
#define KILN_TWICE(K) extern "C" __global__ void __launch_bounds__(64) twice_##K(float* x) { \
    x[threadIdx.x] *= 2.f * K; \
}
KILN_TWICE(1)
KILN_TWICE(2)
extern "C" __global__ void __launch_bounds__(128, 2) plain(const float* __restrict__ a,
                                                          float* b) {
    b[threadIdx.x] = a[threadIdx.x];
}
'''


def test_every_kernel_waits_first():
    source = dependent_launch.with_prior_grid_wait(MACRO_KERNELS)
    assert source.startswith(dependent_launch.WAIT_HELPER)
    assert source.count("kiln_wait_prior_grids();") == 2              # the macro's body and `plain`'s
    assert "twice_##K(float* x) { kiln_wait_prior_grids(); \\\n" in source
    assert "float* b) { kiln_wait_prior_grids();\n    b[threadIdx.x]" in source
    with pytest.raises(ValueError, match="without a body"):
        dependent_launch.with_prior_grid_wait('extern "C" __global__ void declared(float*);\n')


def test_kernels_that_wait_themselves_get_no_second_wait():
    source = dependent_launch.with_prior_grid_wait(MACRO_KERNELS, waiting=("plain",))
    assert "float* b) {\n    b[threadIdx.x]" in source
    assert source.count("{ kiln_wait_prior_grids();") == 1            # the macro's kernels still wait
    assert dependent_launch.with_prior_grid_wait(MACRO_KERNELS, waiting=("twice_1",)).count(
        "{ kiln_wait_prior_grids();") == 2    # a name the source does not spell changes nothing


def test_streaming_kernels_release_the_next_one_whatever_their_grid():
    """The helper lets the next kernel launch early only in grids of at most one block per
    multiprocessor, or where the kernel asks with `release` (the runtime's wait in `streaming`
    kernels)."""
    source = dependent_launch.with_prior_grid_wait(MACRO_KERNELS, streaming=("plain",))
    assert "float* b) { kiln_wait_prior_grids(true);\n    b[threadIdx.x]" in source
    assert source.count("{ kiln_wait_prior_grids();") == 1            # the macro's kernels: by their grid
    assert "if (release || gridDim.x * gridDim.y * gridDim.z <= sms)" in dependent_launch.WAIT_HELPER


@needs_nvrtc
def test_a_gemv_that_prefetches_before_it_waits_compiles(monkeypatch):
    """gemv and gemv_tc with PREFETCH: the kernel waits itself (the helper defined by the
    template and by the runtime, once), the split-K sum kernel after it as every kernel."""
    from kiln_ops_builtin.templates import gemv, gemv_tc
    definition = registry().operator("linear")
    jobs = []
    for module, rows, knobs in ((gemv, 1, {"KW": 4, "PREFETCH": 2}), (gemv_tc, 8, {"KW": 8, "SPLIT": 2, "PREFETCH": 1})):
        x, w = torch.randn(rows, 1000).to(torch.bfloat16), torch.randn(777, 1000).to(torch.bfloat16)
        task = definition.task(definition.bind([x, w], {}))[0]
        program = module.render(task, **knobs)
        kernel = program.launches[0].kernel
        assert program.waiting == (kernel,)
        for setting in ("0", "1"):
            monkeypatch.setenv("KILN_DEPENDENT_LAUNCH", setting)
            source = rt.launch_source(program, "sm_90")
            inserted = len(program.kernel_names) - 1 if setting == "1" else 0      # the split-K sum's
            # streaming kernels: the next kernel launches right after their wait, whatever their grid
            assert source.count("{ kiln_wait_prior_grids(true);") == inserted
            assert source.count("kiln_wait_prior_grids(true);") == inserted + 1    # and the template's own
            jobs += [(source, kernel, "sm_90"), (rt.launch_source(program, "sm_80"), kernel, "sm_80")]
    rt.compile_many(jobs)


def test_enabled_from_sm90_unless_turned_off(monkeypatch):
    monkeypatch.delenv("KILN_DEPENDENT_LAUNCH", raising=False)
    assert dependent_launch.enabled(90) and dependent_launch.enabled(100) and not dependent_launch.enabled(89)
    monkeypatch.setenv("KILN_DEPENDENT_LAUNCH", "0")
    assert not dependent_launch.enabled(90)


@needs_nvrtc
def test_waiting_sources_compile(monkeypatch):
    monkeypatch.setenv("KILN_DEPENDENT_LAUNCH", "1")
    definition = registry().operator("sort")
    task = definition.task(definition.bind([torch.randn(3, 5000)], {"dim": 1}))[0]     # TILE 2048: chunks
    programs = [sort_bitonic.render(task, **knobs) for knobs in sort_bitonic.TEMPLATE.space(1)]
    assert any(len({launch.kernel for launch in p.launches}) > 2 for p in programs)   # merge kernels
    jobs = [(rt.launch_source(p, arch), f"sort{k}", arch)
            for k, p in enumerate(programs) for arch in ("sm_80", "sm_90")]
    jobs.append((dependent_launch.with_prior_grid_wait(MACRO_KERNELS), "macro_kernels", "sm_90"))
    rt.compile_many(jobs)
    assert "kiln_wait_prior_grids" in rt.launch_source(programs[0], "sm_90")
    assert rt.launch_source(programs[0], "sm_80") == programs[0].source


@needs_nvrtc
def test_a_gemv_split_in_a_cluster_is_a_streaming_dependent(monkeypatch):
    """gemv_tc splitting K in a cluster is one kernel (the runtime launches it with the cluster's
    and the dependent launch's attributes together): it waits first and lets the next kernel launch
    right after (streaming), or waits itself after its prefetches."""
    from kiln_ops_builtin.templates import gemv_tc
    definition = registry().operator("linear")
    x, w = torch.randn(8, 1000).to(torch.bfloat16), torch.randn(777, 1000).to(torch.bfloat16)
    task = definition.task(definition.bind([x, w], {}))[0]
    monkeypatch.setenv("KILN_DEPENDENT_LAUNCH", "1")
    jobs = []
    for prefetch in (0, 1):
        program = gemv_tc.render(task, KW=8, SPLIT=2, CLUSTER=True, PREFETCH=prefetch)
        (launch,) = program.launches
        assert launch.cluster == 2 and program.streaming == (launch.kernel,)
        source = rt.launch_source(program, "sm_90")
        assert source.count("{ kiln_wait_prior_grids(true);") == 1 - prefetch
        assert source.count("kiln_wait_prior_grids(true);") == 2 - prefetch     # and the template's own
        jobs.append((source, launch.kernel, "sm_90"))
    rt.compile_many(jobs)

"""PTX wrappers for CUDA templates: asynchronous copies, ldmatrix, mma.sync, wgmma, fences,
mbarriers, TMA copies, shared-memory descriptors and thread-block clusters, each a device
function (or macro) of CUDA C++ source.

A template passes the groups it uses to `kiln.codegen.cuda.template_source(..., ptx=...)`,
which places them after the prelude. Every wrapper is `static __device__ __forceinline__`, so
it costs what the inline `asm` it wraps costs.
"""
from __future__ import annotations

from kiln import dtypes
from kiln.dtypes import DataType

PRIOR_GRIDS = r"""#ifndef KILN_PRIOR_GRIDS
#define KILN_PRIOR_GRIDS
static __device__ __forceinline__ void kiln_wait_prior_grids(bool release = false) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    unsigned sms;
    asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
    if (release || gridDim.x * gridDim.y * gridDim.z <= sms) asm volatile("griddepcontrol.launch_dependents;");
#endif
}
#endif
"""
"""`kiln_wait_prior_grids(release = false)`: wait until the grids launched before this one have
completed and their memory is visible, then, with `release` or in a grid of at most one block
per multiprocessor, let the next kernel launch (`kiln.runtime.dependent_launch` tells why not
otherwise); compiled out below sm_90, and returns at once in a kernel not launched as a
dependent. A template calls it itself only for kernels its program names in
`CudaProgram.waiting`."""

PREFETCH_L2 = r"""
static __device__ __forceinline__ void kiln_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}
"""
"""`kiln_prefetch_l2(p)`: bring the line holding p into L2, a hint that reads nothing into the
thread (safe ahead of `kiln_wait_prior_grids()`: L2 is where every SM's writes meet)."""

CP_ASYNC = r"""
static __device__ __forceinline__ void kiln_cp_async16(void* smem, const void* gmem, int bytes) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(gmem), "r"(bytes));
}
static __device__ __forceinline__ void kiln_cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
// wait until at most N committed groups of this thread's copies are in flight
template <int N> static __device__ __forceinline__ void kiln_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}
"""
"""`kiln_cp_async16(smem, gmem, bytes)`: a 16-byte global-to-shared copy, zero-filled past
`bytes`; `kiln_cp_async_commit()`, `kiln_cp_async_wait<N>()`."""

LDMATRIX = r"""
static __device__ __forceinline__ void kiln_ldmatrix_x4(unsigned* r, const void* smem) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
static __device__ __forceinline__ void kiln_ldmatrix_x4_trans(unsigned* r, const void* smem) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
// the 16-byte chunk `c` of row `r` in a tile whose rows hold `C` chunks, XOR-swizzled
static __device__ __forceinline__ int kiln_swz(int r, int c, int C) {
    return C >= 8 ? (c ^ (r & 7)) : (C == 4 ? (c ^ ((r >> 1) & 3)) : (c ^ ((r >> 2) & 1)));
}
"""
"""`kiln_ldmatrix_x4(regs, smem)` and its `.trans` form; `kiln_swz(r, c, C)`, the XOR swizzle
of 16-byte chunks that keeps both cp.async stores and ldmatrix free of bank conflicts."""

MMA = "".join(f"""
static __device__ __forceinline__ void kiln_mma_m16n8k16_{ab}(float* d, const unsigned* a, const unsigned* b) {{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 "
                 "{{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};\\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}}
""" for ab in ("f16", "bf16"))
"""`kiln_mma_m16n8k16_f16(d, a, b)` and `_bf16`: d (4 floats) += a (4 registers) * b (2)."""

WGMMA = r"""
// the descriptor of a K-major, 128-byte-swizzled shared-memory tile for wgmma
static __device__ __forceinline__ uint64_t kiln_desc(const void* smem) {
    const uint64_t addr = (uint64_t)__cvta_generic_to_shared(smem);
    return ((addr & 0x3FFFFull) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
static __device__ __forceinline__ void kiln_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
static __device__ __forceinline__ void kiln_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void kiln_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// wait until at most N committed wgmma groups are in flight
template <int N> static __device__ __forceinline__ void kiln_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// N registers a wgmma writes or reads, pinned here: the compiler neither reads them before this
// point (after a wait) nor moves their other uses across it
template <int N> static __device__ __forceinline__ void kiln_wgmma_keep(float* r) {
#pragma unroll
    for (int k = 0; k < N; ++k) asm volatile("" : "+f"(r[k]) :: "memory");
}
template <int N> static __device__ __forceinline__ void kiln_wgmma_keep(unsigned* r) {
#pragma unroll
    for (int k = 0; k < N; ++k) asm volatile("" : "+r"(r[k]) :: "memory");
}
"""
"""`kiln_desc(smem)`, `kiln_fence_proxy_async()`, `kiln_wgmma_fence()`, `kiln_wgmma_commit()`,
`kiln_wgmma_wait<N>()`, `kiln_wgmma_keep<N>(regs)` (sm_90a)."""


MBARRIER = r"""
struct alignas(64) CUtensorMap { unsigned long long opaque[16]; };

static __device__ __forceinline__ uint32_t kiln_smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
static __device__ __forceinline__ void kiln_bar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(kiln_smem(bar)), "r"(count));
}
static __device__ __forceinline__ void kiln_bar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(kiln_smem(bar)), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void kiln_bar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(kiln_smem(bar)) : "memory");
}
// an arrival on `bar` once this thread's earlier cp.async copies have landed (counted in the barrier's init count)
static __device__ __forceinline__ void kiln_bar_arrive_cp_async(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(kiln_smem(bar)) : "memory");
}
static __device__ __forceinline__ void kiln_bar_wait(uint64_t* bar, int parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(kiln_smem(bar)), "r"(parity) : "memory");
    } while (!done);
}
// wgmma shared-memory descriptor, 128-byte swizzle; offsets in bytes
static __device__ __forceinline__ uint64_t kiln_gdesc(const void* p, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((kiln_smem(p) & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16)
         | ((uint64_t)(sbo >> 4) << 32) | (1ull << 62);
}
"""
"""Hopper (sm_90) barriers and descriptors: the `CUtensorMap` parameter type, `kiln_smem(p)` (a
shared-memory address), mbarrier `kiln_bar_init(bar, count)`, `kiln_bar_expect(bar, bytes)` (an
arrival expecting `bytes` of asynchronous copies), `kiln_bar_arrive(bar)`,
`kiln_bar_arrive_cp_async(bar)` (`cp.async.mbarrier.arrive.noinc`), `kiln_bar_wait(bar,
parity)`, and `kiln_gdesc(p, lbo, sbo)`, a 128-byte-swizzled wgmma descriptor."""


def _per_rank(name: str, params: str, instruction: str, operands: str, first: int) -> str:
    """Device functions `name` (with `{r}` for the rank) for tensor ranks 2 to 5: `params`, then
    coordinates c0 .. of the box, wrapping the PTX `instruction` (with `{r}` and `{c}`, the
    coordinates' operand slots from `%first` on) over `operands`, then the coordinates; and
    `name` without the rank (`{r}d` dropped) taking any of those ranks, the rank of its
    coordinates."""
    out = []
    for rank in range(2, 6):
        coords = ", ".join(f"int c{d}" for d in range(rank))
        slots = ", ".join(f"%{first + d}" for d in range(rank))
        ins = ", ".join(f'"r"(c{d})' for d in range(rank))
        out.append(f"static __device__ __forceinline__ void {name.format(r=rank)}({params}, {coords}) {{\n"
                   f'    asm volatile("{instruction.format(r=rank, c="{" + slots + "}")};\\n"\n'
                   f"                 :: {operands}, {ins} : \"memory\");\n}}\n")
    args = ", ".join(p.split()[-1].lstrip("*") for p in params.split(", "))
    calls = "\n    else ".join(f"if constexpr (sizeof...(C) == {rank - 2}) {name.format(r=rank)}({args}, c0, c1, c...);"
                               for rank in range(2, 6))
    out.append(f"template <class... C>\nstatic __device__ __forceinline__ void {name.replace('_{r}d', '')}({params}, "
               f"int c0, int c1, C... c) {{\n"
               f'    static_assert(sizeof...(C) <= 3, "tensor maps have ranks 2 to 5");\n    {calls}\n}}\n')
    return "".join(out)


_LOAD = "cp.async.bulk.tensor.{r}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
_TO_SHARED = '"r"(kiln_smem(dst)), "l"((uint64_t)map), "r"(kiln_smem(bar))'
TMA = (_per_rank("kiln_tma_{r}d", "void* dst, const CUtensorMap* map, uint64_t* bar", _LOAD + " [%0], [%1, {c}], [%2]",
                 _TO_SHARED, 3)
       + _per_rank("kiln_tma_store_{r}d", "const CUtensorMap* map, const void* src",
                   "cp.async.bulk.tensor.{r}d.global.shared::cta.bulk_group [%0, {c}], [%1]",
                   '"l"((uint64_t)map), "r"(kiln_smem(src))', 2)
       + r"""
static __device__ __forceinline__ void kiln_bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// wait until at most N committed bulk groups of this thread still read their shared memory
template <int N> static __device__ __forceinline__ void kiln_bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
""")
"""`kiln_tma_{r}d(dst, map, bar, c0 ..)` for ranks 2 to 5: one box copy of a tensor map into
shared memory, completing on mbarrier `bar` (needs MBARRIER before it); `kiln_tma_store_{r}d(map,
src, c0 ..)`: one box copy from shared memory at `src` out to the tensor map (elements outside
the tensor are not written), in this thread's current bulk group; `kiln_tma(..)` and
`kiln_tma_store(..)`: the same at the rank of the coordinates given; `kiln_bulk_commit()` closes
the group, `kiln_bulk_wait_read<N>()` waits until at most N groups still read shared memory."""


DSMEM = r"""
// this CTA's rank in its cluster
static __device__ __forceinline__ uint32_t kiln_cluster_rank() {
    uint32_t r; asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r)); return r;
}
// every thread of every CTA of the cluster meets here (shared memory written before is visible after)
static __device__ __forceinline__ void kiln_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// the float at `p`'s offset in the shared memory of CTA `cta` of the cluster
static __device__ __forceinline__ float kiln_cluster_load(const float* p, uint32_t cta) {
    float v;
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %1, %2;\nld.shared::cluster.f32 %0, [remote];\n}\n"
                 : "=f"(v) : "r"((uint32_t)__cvta_generic_to_shared(p)), "r"(cta) : "memory");
    return v;
}
"""
"""Thread-block clusters' distributed shared memory (sm_90; needs nothing before it):
`kiln_cluster_rank()`, `kiln_cluster_sync()` (every thread of the cluster's CTAs, each warp
converged), `kiln_cluster_load(p, cta)` (a float of CTA `cta`'s shared memory, at `p`'s offset in
this CTA's: read it between two cluster syncs, so that it is written before and the CTA still
runs)."""

CLUSTER = r"""
// an arrival on mbarrier `bar` of CTA `cta` of the cluster (`bar`: this CTA's barrier at the same offset)
static __device__ __forceinline__ void kiln_bar_arrive_cta(uint64_t* bar, uint32_t cta) {
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" :: "r"(kiln_smem(bar)), "r"(cta) : "memory");
}
""" + _per_rank("kiln_tma_{r}d_multicast", "void* dst, const CUtensorMap* map, uint64_t* bar, uint16_t ctas",
                _LOAD + ".multicast::cluster [%0], [%1, {c}], [%2], %3", _TO_SHARED + ', "h"(ctas)', 4)
"""TMA and mbarriers across a thread-block cluster (sm_90; needs MBARRIER and DSMEM before it):
`kiln_bar_arrive_cta(bar, cta)` (an arrival, with the default release at CTA scope, on the
barrier at `bar`'s offset in CTA `cta`), and `kiln_tma_{r}d_multicast(dst, map, bar, ctas, c0
..)`: one box copy into shared memory at `dst`'s offset in every CTA of the mask `ctas`,
completing on the barrier at `bar`'s offset in each (`kiln_tma_multicast(..)`: at the rank of
the coordinates given)."""

def mma_m16n8k16(t: DataType) -> str:
    """The name of MMA's m16n8k16 product with operands of 16-bit float type `t`."""
    if t not in dtypes.HALF_FLOATS:
        raise ValueError(f"mma.sync m16n8k16 takes float16 or bfloat16 operands, not {t.name}")
    return "kiln_mma_m16n8k16_" + ("f16" if t == dtypes.float16 else "bf16")


def _wgmma(name: str, shape: str, ab: str, regs: int, a_regs: bool, tail: str, scale_d: bool) -> str:
    """`#define name(ACC, DA, DB)`: one `wgmma.mma_async` of `shape` accumulating into the `regs`
    floats of ACC, A described by the descriptor DA, or with `a_regs` `name(ACC, A, DB)`, A the
    array of four registers of 16-bit pairs. `tail`: the immediates after scale-d. With
    `scale_d` the macro takes a last argument SD: 0 overwrites ACC with the product."""
    outs = ", ".join(f'"+f"(ACC[{k}])' for k in range(regs))
    slots = ",".join(f"%{k}" for k in range(regs))
    if a_regs:
        a_name, a_slot, a_ins, b = "A", "{" + ",".join(f"%{regs + k}" for k in range(4)) + "}", \
            ", ".join(f'"r"((A)[{k}])' for k in range(4)), regs + 4
    else:
        a_name, a_slot, a_ins, b = "DA", f"%{regs}", '"l"(DA)', regs + 1
    params, sd = (f"ACC, {a_name}, DB, SD", "SD") if scale_d else (f"ACC, {a_name}, DB", "1")
    return (f'#define {name}({params}) asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{b + 1}, 0;\\n'
            f'wgmma.mma_async.sync.aligned.{shape}.f32.{ab}.{ab} {{{slots}}}, {a_slot}, %{b}, p, {tail};\\n}}\\n"'
            f' : {outs} : {a_ins}, "l"(DB), "r"({sd}))\n')


def wgmma_m64k16(bn: int, t: DataType, trans_a: int = 0, trans_b: int = 0, name: str = "WGMMA",
                 scale_d: bool = False) -> str:
    """`#define WGMMA(acc, da, db)`: one wgmma m64n{bn}k16 product of the tiles described by
    `da` and `db` (operands of 16-bit float type `t`; `trans_a`/`trans_b` 1 for an MN-major
    tile) accumulated into the float array `acc`. `name` names the macro; with `scale_d` it
    takes a fourth argument, 0 to overwrite `acc` instead of accumulating."""
    ab = mma_m16n8k16(t).rsplit("_", 1)[1]
    return _wgmma(name, f"m64n{bn}k16", ab, bn // 2, False, f"1, 1, {trans_a}, {trans_b}", scale_d)


def wgmma_m64k16_rs(bn: int, t: DataType, trans_b: int = 0, name: str = "WGMMA_RS") -> str:
    """`#define WGMMA_RS(acc, a, db)`: one wgmma m64n{bn}k16 product of A in registers (`a`: four
    registers of two 16-bit floats of type `t`, laid out as mma.sync's m16n8k16 A fragment, the
    warp's 16 rows of the 64) and the tile described by `db` (`trans_b` 1 for an MN-major
    tile), accumulated into the float array `acc`."""
    ab = mma_m16n8k16(t).rsplit("_", 1)[1]
    return _wgmma(name, f"m64n{bn}k16", ab, bn // 2, True, f"1, 1, {trans_b}", False)


def wgmma_m64k8_tf32(bn: int) -> str:
    """`#define WGMMA(acc, da, db)`: one wgmma m64n{bn}k8 product of float32 tiles read as TF32
    (both K-major: TF32 operands have no transpose bit), accumulated into the float array `acc`."""
    return _wgmma("WGMMA", f"m64n{bn}k8", "tf32", bn // 2, False, "1, 1", False)

CVT_EX2 = r"""
// two floats rounded to one register of 16-bit floats, `lo` in the low half
static __device__ __forceinline__ unsigned kiln_pack_f16x2(float lo, float hi) {
    unsigned r; asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
static __device__ __forceinline__ unsigned kiln_pack_bf16x2(float lo, float hi) {
    unsigned r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
// 2^x by the special function unit (ex2.approx: 2 ulp; 2^-inf = 0)
static __device__ __forceinline__ float kiln_ex2(float x) {
    float y; asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x)); return y;
}
"""
"""`kiln_pack_f16x2(lo, hi)`, `kiln_pack_bf16x2(lo, hi)` (sm_80) and `kiln_ex2(x)`."""


def pack_16x2(t: DataType) -> str:
    """The name of the wrapper packing two floats into one register of 16-bit float type `t`."""
    return "kiln_pack_" + mma_m16n8k16(t).rsplit("_", 1)[1] + "x2"

"""The Hopper contraction engine: one persistent, warp-specialized wgmma kernel that gemm_sm90
(matmul, linear) and conv_sm90 (implicit-GEMM convolution) instantiate.

One producer warpgroup (registers lowered with `setmaxnreg.dec`) walks the CTA's output tiles
and fills a STAGES-deep ring of shared memory with 128-byte-deep slices of K of A and B in the
layout TMA's 128-byte swizzle gives; each slot has a *full* mbarrier (the copies' transaction
bytes and arrivals) and an *empty* one (the consumers' release). How a slot is filled is the
instantiating template's `Producer`: thread 0 issues TMA box copies (`cp.async.bulk.tensor`)
after expecting their bytes, and where an operand is no box (the im2col of a convolution)
`threads` producer threads gather it with `cp.async` into the same swizzled layout, each
signalling the full barrier with `cp.async.mbarrier.arrive.noinc` (counted in its init count),
and the consumers fence the async proxy before reading such a slot.

A stage's rows are 128 bytes of K: KB = 64 elements of 16-bit operands, or 32 float32
operands that the tensor cores read as TF32 (`k_block`; TF32 operands must both be K-major).
CW consumer warpgroups (`setmaxnreg.inc`) each own MI slabs of 64 rows x BN columns of the
BM x BN tile and multiply with `wgmma.mma_async.m64n{BN}k16` (k8 for TF32: the same 32 bytes
of K) straight from shared memory, one group in flight, then run the core's epilogue hooks
(through split_k's `kiln_store2_fetched`) while the producer already fetches the next tile;
each warp first stages 16 x 32 blocks of its accumulators in shared memory, so every store
instruction writes two whole 128-byte rows. Where the output stores
16-byte packs (VEC), each lane instead takes VEC neighbouring outputs of a row through the
core's vector hook (`kiln_epilogue_v`). With TMA_STORE = 1, where the output is a 16-bit
matrix TMA can describe (`output_map`), each warp instead packs its 16 x 64 blocks straight from
the accumulators through `kiln_epilogue2_packed` into a 128-byte-swizzled 2 KB tile of shared
memory (the staging area, free then) and stores it with one TMA copy, which clips what lies past
M and N: nothing staged in float32, and the stores leave the load/store pipeline. Else, with
PACKED = 1 (GemmKnobs' default) where TMA could so store the output, the warp packs the same tile
and reads it back a 128-byte row per 8 lanes for 16-byte stores: a 16 x 64 block then takes
about a third of the shared-memory wavefronts that float32 staging (with its 2-way bank conflicts)
and the vector hook's per-row loads take. On short main loops that paid even with ping-pong,
whose epilogue overlaps the other consumer's main loop: its shared-memory and L1 traffic slows
that main loop's TMA writes and wgmma reads (H200, GPT-2's linears: 1.01-1.12x). The packing reads
what the hook reads at the last row and column in range for places past M and N (their stores are
dropped), so the calls of rows r and r + 8 share their loads of a bias. What the
epilogue reads per element at m * row_stride + n (a residual: the match's `sources`) comes as
BM x BN tiles by TMA, issued by the producer after the tile's operands into one of two buffers
with their own full and empty mbarriers (`staged_stages`: the ring is made shallower where
shared memory needs it). With PP = 1 (ping-pong) the
two consumers take whole 64*MI x BN tiles in turn instead of sharing one: named barriers let
one consumer at a time run its main loop, and its epilogue overlaps the other's MMA. Tiles are
taken by a persistent grid of at most one CTA per SM, in groups of GROUP tile rows (grouped
rasterization) for L2 reuse. Split-K (SPLIT > 1) makes work units (tile, split) and sums the
float32 partials in `split_k`'s kernel. With CLUSTER = 2 the CTAs run in thread-block clusters
of two that take vertically adjacent tiles together: the producer of each loads its own A and
half of the shared B tile into both CTAs' slots (TMA multicast), so each slot's empty barrier
counts the releases of both CTAs' consumers (one per warp, the peer's by a remote arrive), and a
producer stays until the peer's last releases have arrived before its CTA may exit.

The device code is `cuda/sm90_engine.cuh`: `kiln::sm90::run<P>`, the kernel's body over a
program struct P that `program` renders (`kiln_sm90_program`): the knobs and what derives from
them as enumerators, the tensor maps, and the hooks of this instantiation as member functions
(the producer's copies, each operand's a call of `kiln::sm90::load_operand` that `TmaLoad`
renders, its tensor map's batch dims a `kiln::tma::Batch` of `cuda/tma_batch.cuh`; the epilogue
sources' copies and reads; the vector hook's stores and the TMA stores' packing), then the
`extern "C"` kernel of a line that calls `run` with its arguments and tensor maps. Knobs:
`EngineKnobs`, which each template subclasses (`gemm_sm90.GemmKnobs`: its level-0 defaults;
`conv_sm90.ConvKnobs`: no clusters or TMA stores, its producer's registers).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from kiln.template import (Const, CudaDialect, CudaProgram, DataType, EpilogueOutput, EpilogueSource, Knobs,
                           KernelArgs, Launch, SizeArgs, TensorMapArg, Var, as_dim, device_code, dtypes, linear_terms, ptx,
                           SymSize, render_vector_epilogue, row_major_strides, simplify, template_source, vector_stores)
from kiln_ops_builtin.templates import split_k

BK = 64              # 16-bit units in a stage's row: 128 bytes, the swizzle's width
MAX_SMEM = 227 * 1024
MN_LBO = 8192        # bytes between 64-element MN chunks of an MN-major stage (one 64 x 64 box)
SWIZZLE_ATOM = 1024  # bytes of eight 128-byte rows: the swizzle pattern's period
EPI_LD = 36          # floats per row of a warp's 16 x 32 epilogue staging block (padded against bank conflicts)
REGISTERS = 65536     # the register file, shared out between the warpgroups by setmaxnreg
EPILOGUE_REGS = 72    # a consumer's registers besides its accumulators and fetched values
MIN_STAGED_STAGES = 3
MAX_STAGED_K_TILES = 16
"""Staging pays where the sources' reads weigh against a short main loop (ResNet's 1x1
convolutions, K <= 512); on longer ones the shallower ring costs more than the epilogue's loads
from global memory (H100, a linear of 1576 x 3072 -> 768 with two residuals: 23.8 us staged at 3
stages, 19.6 us loading them; at K = 768 staging wins or ties)."""

# What cuda/sm90_engine.cuh's run<P> reads of a program, and the kernel that calls it
PROGRAM = """
struct kiln_sm90_program {{
    enum : int {{ {enums} }};
    struct Maps {{ const CUtensorMap {maps}; }};
{members}}};

extern "C" __global__ void __launch_bounds__({threads}, 1) {kernel}(PARAMS, {map_params}) {{
    kiln::sm90::run<kiln_sm90_program>(KERNEL_ARGS, {{{map_args}}});
}}
"""

# The program's member functions: thread 0's copies of a slot, of the epilogue's source tiles
LOAD = """\
    static __device__ __forceinline__ void load(uint16_t* as, uint16_t* bs, uint64_t* bar, int k0, int64_t m0,
                                                int64_t n0, int bz, int rank, const Maps& maps, PARAMS) {{
        {body}
    }}
"""
LOAD_SOURCES = """\
    static __device__ __forceinline__ void load_sources(unsigned char* tiles, uint64_t* bar, int64_t m0, int64_t n0,
                                                        const Maps& maps) {{
        {body}
    }}
"""
# ... what the stores will read of a row pair, VEC outputs through the vector hook, a TMA store's pair
FETCH = """\
    static __device__ __forceinline__ void fetch(PARAMS, const unsigned char* tiles, int64_t b, int64_t m, int64_t n,
                                                 kiln_fetched& f, int at) {{
        {body};
    }}
"""
STORE_V = """\
    static __device__ __forceinline__ void store_v(PARAMS, const unsigned char* tiles, int64_t b, int64_t m, int64_t n,
                                                   const float* v, int at) {{
        kiln_epilogue_v(ARGS, b, m, n, v{tiles});
    }}
"""
PACK2 = """\
    static __device__ __forceinline__ uint32_t pack2(PARAMS, int64_t b, int64_t m, int64_t n, float v0, float v1) {
        return kiln_epilogue2_packed(ARGS, b, m, n, v0, v1);
    }
"""
# ... and with PACKED, an output's address
OUT_AT = """\
    static __device__ __forceinline__ void* out_at(PARAMS, int64_t b, int64_t m, int64_t n) {{
        return &{out}[b * {sb}LL + m * {sm}LL + n];
    }}
"""


@dataclass(frozen=True)
class EngineKnobs(Knobs):
    """The engine's knobs: BM x BN tiles (BN a multiple of 32 up to 256) on CW consumer
    warpgroups of MI 64-row slabs each, or with PP = 1 (ping-pong, CW = 2) each consumer taking
    whole 64 * MI-row tiles in turn; a ring of STAGES slots; K split SPLIT ways (`split_k`);
    grouped rasterization of GROUP tile rows; the epilogue fetching what it reads FETCH blocks
    ahead (0: `fetch_depth`'s choice); clusters of CLUSTER (1 or 2) CTAs sharing B by multicast;
    TMA_STORE = 1 storing 16-bit outputs by TMA where `output_map` can describe them (BN a
    multiple of 64), else PACKED = 1 packing them in registers as TMA_STORE does and storing them
    from the lanes, 16 bytes each, where it can and BN is a multiple of 64 (no float32 staging).
    Valid where the setting fits shared memory and the consumers' registers
    beside a producer of `producer_regs()` registers. The defaults: 128 x 256 tiles on two
    consumers, four stages."""

    BN: int = 256
    CW: int = 2
    MI: int = 1
    STAGES: int = 4
    SPLIT: int = 1
    PP: int = 0
    GROUP: int = 8
    FETCH: int = 0
    CLUSTER: int = 1
    TMA_STORE: int = 0
    PACKED: int = 0

    @classmethod
    def tile(cls, bn: int, cw: int, mi: int, stages: int, pp: int = 0, **others) -> EngineKnobs:
        """The setting of a tile (BN, CW, MI, STAGES, PP) alone (CLUSTER = 1), the other knobs at
        their defaults or `others`."""
        return cls(**{"BN": bn, "CW": cw, "MI": mi, "STAGES": stages, "PP": pp, "CLUSTER": 1, **others})

    @property
    def BM(self) -> int:
        """The tile's rows: 64 * MI per consumer, times CW unless they take tiles in turn (PP)."""
        return 64 * self.MI * (1 if self.PP else self.CW)

    def producer_regs(self) -> int:
        """The producer warpgroup's registers: 40, a thread issuing TMA copies."""
        return 40

    def valid(self) -> bool:
        return (self.BN % 32 == 0 and 32 <= self.BN <= 256 and self.CW >= 1 and self.MI >= 1 and self.STAGES >= 2
                and self.SPLIT >= 1 and self.PP in (0, 1) and self.GROUP >= 1 and self.FETCH >= 0
                and self.CLUSTER in (1, 2) and self.TMA_STORE in (0, 1) and (not self.TMA_STORE or self.BN % 64 == 0)
                and self.PACKED in (0, 1)
                and self.fits(self.producer_regs()))

    def source_bytes(self, sources: tuple[EpilogueSource, ...]) -> int:
        """Bytes of one tile of every epilogue source."""
        return sum(self.BM * self.BN * s.dtype.nbytes for s in sources)

    def smem_bytes(self, sources: tuple[EpilogueSource, ...] = ()) -> int:
        """Shared memory of the setting: the ring, two buffers of the epilogue's source tiles, the
        barriers, the epilogue's staging blocks and 1024 bytes of alignment."""
        return (self.STAGES * ((self.BM + self.BN) * BK * 2 + 16) + 2 * self.source_bytes(sources) + 32
                + 1024 + self.CW * 4 * 16 * EPI_LD * 4)

    def fits(self, producer_regs: int) -> bool:
        """Whether the setting fits shared memory and, at 128 accumulators per thread at most, the
        consumers' registers beside a producer of `producer_regs` (ping-pong: CW = 2)."""
        accumulators = self.BN // 2 * self.MI
        return (accumulators <= 128 and accumulators + 56 <= consumer_registers(self.CW, producer_regs)
                and self.smem_bytes() <= MAX_SMEM and (not self.PP or self.CW == 2))

    def staged_stages(self, sources: tuple[EpilogueSource, ...], k_tiles: int) -> int | None:
        """The ring depth (at most STAGES, at least MIN_STAGED_STAGES) at which the setting also
        holds two buffers of the source tiles, or None where it cannot or should not (sources then
        load from global memory in the epilogue): split-K stages nothing (its partials' sum reads
        them), nor does a main loop of more than MAX_STAGED_K_TILES k-tiles."""
        if (not sources or self.SPLIT > 1 or k_tiles > MAX_STAGED_K_TILES
                or any(s.row_stride * s.dtype.nbytes % 16 for s in sources)):
            return None
        for stages in range(self.STAGES, MIN_STAGED_STAGES - 1, -1):
            if replace(self, STAGES=stages).smem_bytes(sources) <= MAX_SMEM:
                return stages
        return None

    def fetch_depth(self, producer_regs: int) -> int:
        """How many 16 x 32 epilogue blocks ahead a consumer loads what the epilogue reads (1 to
        BN / 32 - 1, at most 3): as many as the registers the accumulators leave hold, a block
        taking 16 (one 16-bit residual: 8 rows x 2 values)."""
        free = consumer_registers(self.CW, producer_regs) - self.BN // 2 * self.MI - EPILOGUE_REGS
        return max(1, min(free // 16 - 1, self.BN // 32 - 1, 3))


@dataclass(frozen=True)
class TmaLoad:
    """Thread 0's TMA copy of operand `operand`'s ("A" or "B") tile into its stage through tensor
    map `map` (`kiln::sm90::load_operand`): K-major, one box of `part` rows; MN-major (`trans`,
    wgmma's transpose bit), `part` boxes of 64 rows. Where a cluster of `parts` CTAs shares the
    tile, each copies its part into every CTA's stage by multicast. `batch`: the map's batch
    dimensions (`kiln::tma::Batch`), each (inner, size) in C: the coordinate of the tile's flat
    batch bz is bz / inner % size."""

    operand: str
    map: TensorMapArg
    part: int
    trans: int = 0
    parts: int = 1
    batch: tuple[tuple[str, str], ...] = ()

    def call(self) -> str:
        """The C of the copy in the program's member `load`."""
        stage, x0 = ("as", "m0") if self.operand == "A" else ("bs", "n0")
        dims = ", ".join(f"{{{inner}, {size}, 1}}" for inner, size in self.batch)
        batch = f"kiln::tma::Batch<{len(self.batch)}>{{{{{dims}}}}}" if dims else "kiln::tma::Batch<0>{}"
        args = ", ".join((stage, f"maps.{self.operand}", "bar", "k0", f"(int){x0}", "rank", batch, "bz"))
        return f"kiln::sm90::load_operand<{self.trans}, {self.part}, {self.parts}>({args});"


@dataclass
class Producer:
    """How the producer warpgroup fills a ring slot. Thread 0 expects `tma_bytes` and issues
    `loads` (one per operand that TMA loads: the program's member `load`). With `threads` > 1,
    each of them also keeps a `Gather` (the program's member type, declared by `members`:
    constructed from (tid, m0, ARGS) once per tile, called with (as, k0, bar, ARGS) per slot,
    ending with one `kiln_bar_arrive_cp_async(bar)` per thread). `regs` is the producer's
    register budget; `enums` (the program's enumerators), `members` and `source` (device code
    ahead of the program) go with the program."""

    loads: tuple[TmaLoad, ...]
    tma_bytes: int
    threads: int = 1
    regs: int = 40
    enums: dict = field(default_factory=dict)
    members: str = "    using Gather = kiln::sm90::NoGather;\n"
    source: str = ""

    @property
    def maps(self) -> dict[str, TensorMapArg]:
        """The loads' tensor maps by operand."""
        return {load.operand: load.map for load in self.loads}

    def trans(self, operand: str) -> int:
        """1 where `operand`'s stage is MN-major (wgmma's transpose bit)."""
        return next((load.trans for load in self.loads if load.operand == operand), 0)


def k_block(dtype: DataType) -> int:
    """Elements of K in one 128-byte stage row: 64 for 16-bit operands, 32 for TF32 (float32)."""
    return 128 // dtype.nbytes


def wgmma(bn: int, dtype: DataType, trans_a: int, trans_b: int) -> str:
    """The WGMMA macro for operands of `dtype` (16-bit, or float32 read as TF32, K-major only)."""
    if dtype == dtypes.float32:
        if trans_a or trans_b:
            raise ValueError("TF32 wgmma reads K-major operands only")
        return ptx.wgmma_m64k8_tf32(bn)
    return ptx.wgmma_m64k16(bn, dtype, trans_a, trans_b)


@dataclass
class Problem:
    """A batch x M x N x K contraction with operands of `dtype` (16-bit floats, or float32 read
    as TF32), and its kernel parameters, their names (`args`), the epilogue hooks the core
    rendered and the inputs the epilogue reads per element (`kiln.codegen.hooks.EpilogueSource`).
    Symbolic sizes among M, N, K and batch (`kiln.ir.size.SymSize`) are written through `sizes`,
    whose parameters end `params`; its values go with the program."""

    M: int
    N: int
    K: int
    batch: int
    dtype: DataType
    params: str
    args: str
    epilogue: str
    sizes: SizeArgs = field(default_factory=SizeArgs)
    sources: tuple[EpilogueSource, ...] = ()
    output: EpilogueOutput | None = None


def consumer_registers(cw: int, producer_regs: int = 40, most: int = 232) -> int:
    """Registers per consumer thread after `setmaxnreg`: what the register file leaves beside
    the producer warpgroup's, rounded down to a multiple of 8, at most `most`."""
    return min(most, (REGISTERS - 128 * producer_regs) // (128 * cw) // 8 * 8)


def program(kernel: str, p: Problem, producer: Producer, knobs: EngineKnobs) -> CudaProgram:
    """The engine's program for problem `p` filled by `producer` at the setting `knobs`, kernel
    named `kernel`. Where `staged_stages` allows, the epilogue's sources come as tiles by TMA, and
    the ring is that deep. With CLUSTER = 2 the CTAs run in clusters of two that take vertically
    adjacent tiles together, and `producer` fills both CTAs' slots of what they share (by TMA
    multicast, rank `rank` of the pair issuing its half): each slot is then released by the
    consumers of both CTAs. With TMA_STORE = 1 the epilogue stores its outputs by TMA where
    `output_map` can describe them, else with PACKED = 1 (and BN a multiple of 64) packed from the
    lanes there; elsewhere it stores as without."""
    if knobs.CLUSTER > 1 and producer.threads > 1:
        raise ValueError(f"{kernel}: CLUSTER={knobs.CLUSTER}; the engine runs clusters of 2 only where the "
                         "producer loads by TMA alone")
    if not knobs.fits(producer.regs):
        raise ValueError(f"{kernel}: {knobs} needs {knobs.smem_bytes()} bytes of shared memory "
                         f"(at most {MAX_SMEM}) or more accumulators than the consumers' registers hold")
    kb = k_block(p.dtype)
    stages = knobs.staged_stages(p.sources, -(-p.K // kb))
    sources = p.sources if stages else ()
    ring = replace(knobs, STAGES=stages) if stages else knobs
    args, temporaries = tuple(p.args.split(", ")), []
    sk = split_k.plan(knobs.SPLIT, p.M, p.N, p.K, kb, p.batch, p.params, args, temporaries, text=p.sizes.text)
    gathered = producer.threads > 1
    maps = {**producer.maps, **_source_maps(sources, p.M, p.N, ring.BM, ring.BN)}
    vec, vector_hook = _vector_epilogue(p, knobs.SPLIT, sources)
    packs = knobs.TMA_STORE or (knobs.PACKED and knobs.BN % 64 == 0)
    out_map = output_map(p) if packs and knobs.SPLIT == 1 and not sources else None
    tma_store, packed = bool(out_map) and bool(knobs.TMA_STORE), bool(out_map) and not knobs.TMA_STORE
    if tma_store:
        maps["O"] = out_map
    fetches = bool(sources) or knobs.SPLIT == 1
    enums = {
        "BM": ring.BM, "BN": ring.BN, "BK": BK, "KB": kb, "EPI_LD": EPI_LD, "CW": ring.CW, "MI": ring.MI, "PP": ring.PP,
        "STAGES": ring.STAGES, "GROUP": ring.GROUP, "FETCH": ring.FETCH or ring.fetch_depth(producer.regs),
        "CLUSTER": ring.CLUSTER, "TRANS_A": producer.trans("A"), "TRANS_B": producer.trans("B"),
        "SWIZZLE_ATOM": SWIZZLE_ATOM, "MN_LBO": MN_LBO, "PRODUCERS": producer.threads, "GATHERED": int(gathered),
        "FULL_ARRIVALS": producer.threads + 1 if gathered else 1,
        "TMA_BYTES": producer.tma_bytes, "PRODUCER_REGS": producer.regs,
        "CONSUMER_REGS": consumer_registers(ring.CW, producer.regs), "NSRC": len(sources),
        "SRC_BYTES": ring.source_bytes(sources), "FETCHES": int(fetches), "VEC": vec,
        "TMA_STORE": int(tma_store), "PACKED": int(packed),
        **producer.enums,
    }
    if tma_store:
        enums["O_BATCHED"] = int(len(out_map.dims) > 2)
    members = (producer.members + LOAD.format(body=" ".join(load.call() for load in producer.loads))
               + _source_members(sources, ring, fetches))
    if vec:
        members += STORE_V.format(tiles=", at, " + _source_tiles(sources, ring) if sources else "")
    if out_map:
        members += PACK2
    if packed:
        members += OUT_AT.format(out=out_map.param, sm=out_map.strides[1],
                                 sb=out_map.strides[2] if len(out_map.strides) > 2 else 0)
    rendered = PROGRAM.format(enums=", ".join(f"{name} = {v}" for name, v in enums.items()),
                              maps=", ".join(f"*{name}" for name in maps), members=members,
                              threads=128 * (ring.CW + 1), kernel=kernel,
                              map_params=", ".join(f"const __grid_constant__ CUtensorMap tm{name}" for name in maps),
                              map_args=", ".join(f"&tm{name}" for name in maps))
    defines = {"M": p.sizes.text(p.M), "N": p.sizes.text(p.N), "K": p.sizes.text(p.K), "ARGS": p.args, **sk.defines}
    groups = [ptx.CP_ASYNC] * gathered + [ptx.MBARRIER, ptx.TMA, ptx.DSMEM, ptx.CLUSTER]
    source = template_source([wgmma(ring.BN, p.dtype, producer.trans("A"), producer.trans("B")), producer.source,
                              sk.stores, device_code(__package__, "cuda/tma_batch.cuh", "cuda/sm90_engine.cuh"),
                              rendered, sk.source],
                             defines, p.epilogue + vector_hook, ptx=groups)
    units = as_dim(-(-p.M // (ring.BM * ring.CLUSTER)) * -(-p.N // ring.BN) * p.batch * ring.SPLIT)
    launches = [Launch(kernel, args + sk.args + tuple(maps.values()), (128 * (ring.CW + 1), 1, 1),
                       items=units * ring.CLUSTER, per_block=1, waves=1, smem=ring.smem_bytes(sources),
                       cluster=ring.CLUSTER)] + sk.launches
    return CudaProgram(source, launches, temporaries, arch_suffix="a", min_arch=90, alignment=16,
                       sizes=p.sizes.values)


def output_map(p: Problem) -> TensorMapArg | None:
    """The output as a tensor map of 16 x 64 boxes (128-byte swizzled), with a batch dimension
    where the batch has a stride (`kiln::sm90::store_tile` stores a box),
    where the output is 16-bit, its element (b, m, n) at b * sb + m * sm + n for fixed strides
    (M and the batch may be symbolic), N even and the strides multiples of 16 bytes; else None."""
    o = p.output
    if o is None or o.out.dtype.nbytes != 2 or isinstance(p.N, SymSize) or p.N % 2:    # rows of N apart: N fixed
        return None
    b, m, n = Var("b", max(as_dim(p.batch), 1)), Var("m", as_dim(p.M)), Var("n", as_dim(p.N))
    index = o.index_of(b, m, n)
    flat = sum((index[id(a)] * s for a, s in zip(o.out.axes, row_major_strides(o.out.shape))), Const(0, dtypes.int64))
    terms, const = linear_terms(simplify(flat))
    coef = {id(t): k for t, k in terms}
    if (const or len(coef) != len(terms) or coef.get(id(n)) != 1
            or any(id(t) not in (id(b), id(m), id(n)) or not isinstance(k, int) for t, k in terms)):
        return None
    sm, sb = coef.get(id(m), 0), coef.get(id(b), 0)
    batched = p.batch > 1 and sb
    if not sm or sm * 2 % 16 or (batched and sb * 2 % 16):
        return None
    dims = (p.N, p.M) + ((as_dim(p.batch),) if batched else ())
    strides = (1, sm) + ((sb,) if batched else ())
    return TensorMapArg(KernelArgs.output(0), o.out.dtype, dims, strides, (64, 16) + (1,) * (len(dims) - 2))




def _source_maps(sources: tuple[EpilogueSource, ...], M: int, N: int, bm: int, bn: int) -> dict[str, TensorMapArg]:
    """Tensor maps S0, S1, .. of the sources as M x N matrices, a box a bm x bn tile (unswizzled)."""
    return {f"S{k}": TensorMapArg(s.param, s.dtype, (as_dim(N), as_dim(M)), (1, as_dim(s.row_stride)), (bn, bm), swizzle=0)
            for k, s in enumerate(sources)}


def _source_offsets(sources: tuple[EpilogueSource, ...], knobs: EngineKnobs) -> list[int]:
    """Each source's tile's byte offset in a buffer of them."""
    return [knobs.source_bytes(sources[:k]) for k in range(len(sources))]


def _source_tiles(sources: tuple[EpilogueSource, ...], knobs: EngineKnobs) -> str:
    """The tiles of the buffer `tiles`, as the hooks take them."""
    return ", ".join(f"(const {CudaDialect().storage_type(s.dtype)}*)(tiles + {at})"
                     for s, at in zip(sources, _source_offsets(sources, knobs)))


def _source_members(sources: tuple[EpilogueSource, ...], knobs: EngineKnobs, fetches: bool) -> str:
    """The members `load_sources` (thread 0's copies into the buffer `tiles`) and `fetch` (the
    epilogue's per-row loads, from tile element `at` of `tiles` where staged); no `fetch` where
    nothing is fetched (K split: the epilogue runs in the sum kernel)."""
    if not sources:
        return FETCH.format(body="kiln_store_fetch2(KERNEL_ARGS, b, m, n, f)") if fetches else ""
    load = " ".join(f"kiln_tma_2d(tiles + {at}, maps.S{k}, bar, (int)n0, (int)m0);"
                    for k, at in enumerate(_source_offsets(sources, knobs)))
    return (LOAD_SOURCES.format(body=load)
            + FETCH.format(body=f"kiln_fetch2_staged(ARGS, b, m, n, f, at, {_source_tiles(sources, knobs)})"))


def _vector_epilogue(p: Problem, split: int, sources: tuple[EpilogueSource, ...]) -> tuple[int, str]:
    """(VEC, hook source) of the epilogue: VEC = 16 bytes of outputs per lane through
    `kiln_epilogue_v` (reading the staged `sources` in their tiles) where the output stores such
    packs (`vector_stores`) and nothing is split, else VEC = 0 (pairs through `kiln_epilogue2`)."""
    o = p.output
    vec = 16 // o.out.dtype.nbytes if o is not None and o.out.dtype.nbytes in (2, 4) else 0
    if split > 1 or not vec or not vector_stores(o.out, o.index_of, vec, o.extents):
        return 0, ""
    return vec, render_vector_epilogue(o.lowered, o.out, o.decl, o.index_of, vec, o.extents, o.sizes, sources)

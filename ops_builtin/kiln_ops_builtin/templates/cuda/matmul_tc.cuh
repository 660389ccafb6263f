// The pieces of kiln_ops_builtin.templates.matmul_tc's kernel (cuda/matmul_tc_kernel.cuh; the
// template's docstring tells the algorithm): the knobs as a type and an operand as the kernel reads it.
//
// Needs the CUDA prelude (fixed-width integers) ahead of it.

namespace kiln::matmul_tc {

// The compile-time knobs (matmul_tc.py's TcKnobs): a Bm x Bn block tile of Wm x Wn warp tiles,
// k-tiles of Bk in a ring of Stages shared-memory stages, tiles handed out in groups of Group
// rows of tiles. Enumerators, not static constexpr members: those are emitted as .global constants.
template <int Bm, int Bn, int Bk, int Wm, int Wn, int Stages, int Group>
struct Tile {
    enum { BM = Bm, BN = Bn, BK = Bk, WM = Wm, WN = Wn, STAGES = Stages, GROUP = Group };
    enum { NT = (Bm / Wm) * (Bn / Wn) * 32 };     // threads of a block: a warp a warp tile
};

// An operand of batch bz: its elements' 16 bits from p, rows (m of A, n of B) x_stride apart and
// k k_stride apart (B only, where it is [K, N] row-major; A and a k-major B are k-contiguous)
struct Operand {
    const uint16_t* p;
    int64_t x_stride, k_stride;
};

}  // namespace kiln::matmul_tc

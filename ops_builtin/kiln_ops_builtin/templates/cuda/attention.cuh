// What the fused attention kernels share (kiln_ops_builtin.templates.attention_*): how the mask
// hook's value enters a score. A program names its mask kind (NoMask, BoolMask, FloatMask) as
// its type Mask; where Mask::PRESENT, Mask::apply(x, b, i, j, ARGS) applies the core-rendered
// hook kiln_mask(PARAMS, b, i, j) (rendered only where the task has a mask) to the score x of
// flat batch b, query i, key j, in the log2 domain.

namespace kiln::attention {

struct NoMask {
    enum : bool { PRESENT = false };
    template <typename... Args>
    static __device__ __forceinline__ void apply(float&, int64_t, int64_t, int64_t, Args...) {}
};

// A bool mask: the score drops out (-inf) where the mask is false.
struct BoolMask {
    enum : bool { PRESENT = true };
    template <typename... Args>
    static __device__ __forceinline__ void apply(float& x, int64_t b, int64_t i, int64_t j, Args... args) {
        if (!kiln_mask(args..., b, i, j)) x = -INFINITY;
    }
};

// A float mask: added to the score (scaled into the log2 domain).
struct FloatMask {
    enum : bool { PRESENT = true };
    template <typename... Args>
    static __device__ __forceinline__ void apply(float& x, int64_t b, int64_t i, int64_t j, Args... args) {
        x += kiln_mask(args..., b, i, j) * 1.4426950408889634f;
    }
};

}  // namespace kiln::attention

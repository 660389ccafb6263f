"""The CUDA C++ dialect: types, the prelude every kernel starts with, and warp/block reductions.

Kernels compile with NVRTC and no include path, so the prelude defines the fixed-width integer
types itself and converts 16-bit floats with PTX instructions (they are stored as raw
`uint16_t` bits, as in the C dialect). `kiln_pack<T, V>` is V values of T read or written as
one aligned access (16 bytes at most). The arithmetic helpers are the C dialect's, made device
functions, so both backends compute the same values.
"""
from __future__ import annotations

from typing import Sequence

from kiln.codegen.c import C_PRELUDE
from kiln.codegen.emitter import Dialect, reduce_combine
from kiln.dtypes import DataType

_SHARED_HELPERS = C_PRELUDE[C_PRELUDE.index("#define KILN_FLOAT_HELPERS"):].replace(
    "static inline", "static __device__ __forceinline__")

CUDA_PRELUDE = r"""
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
#ifndef INT64_MIN
#define INT64_MIN (-9223372036854775807LL - 1)
#endif

static __device__ __forceinline__ float kiln_h2f(uint16_t h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
static __device__ __forceinline__ uint16_t kiln_f2h(float f) {
    uint16_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
static __device__ __forceinline__ float kiln_bf2f(uint16_t b) { return __uint_as_float(((uint32_t)b) << 16); }
static __device__ __forceinline__ uint16_t kiln_f2bf(float f) {
    uint16_t h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
template <typename T, int V>
struct alignas(sizeof(T) * V < 16 ? sizeof(T) * V : 16) kiln_pack { T v[V]; };
""" + _SHARED_HELPERS


class CudaDialect(Dialect):
    """CUDA C++ for NVRTC."""

    prelude = CUDA_PRELUDE

    def fail(self, code: int, check, reported: str) -> str:
        """A failed check traps, as PyTorch's device-side assertions do: the kernel stops, and
        the next synchronizing call raises; the message goes to the device's printf buffer."""
        text = f"Kiln: {check.error}: {check.message}"
        text = text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("{value}", "%lld")
        return f'{{ printf("{text}\\n", (long long)({reported})); __trap(); }}'

    def unary(self, op: str, t: DataType, a: str, at: DataType) -> str:
        """As C, except the approximate forms of float32 (`UnaryOp.EXP_APPROX`: `__expf`,
        ex2.approx after a multiply, at most 2 + 1.173 |x| ulps; `RECIPROCAL_APPROX`:
        `__fdividef`, 2 ulps for |x| in [2^-126, 2^126], 0 beyond)."""
        if t.name == "float32" and op == "exp_approx":
            return f"__expf({a})"
        if t.name == "float32" and op == "reciprocal_approx":
            return f"__fdividef(1.0f, {a})"
        return super().unary(op, t, a, at)

    def shuffle_xor(self, t: DataType, value: str, lane_mask: int) -> str:
        """`value` of the lane whose id differs by `lane_mask` (all 32 lanes take part)."""
        vt = self.value_type(t)
        if t.is_float or t.nbytes >= 4:
            return f"__shfl_xor_sync(0xffffffffu, {value}, {lane_mask})"
        return f"(({vt})__shfl_xor_sync(0xffffffffu, (int){value}, {lane_mask}))"

    def combine(self, op: str, t: DataType, acc: str, other: str) -> str:
        """The statement folding a partial result `other` into `acc` (sum, prod, max, min)."""
        return reduce_combine(op, t, acc, other, self)

    def arg_better(self, op: str, t: DataType, v: str, acc: str) -> str:
        """Whether `v` beats `acc` for argmax/argmin (NaN beats any number, as in PyTorch)."""
        cmp = ">" if op == "argmax" else "<"
        nan = f" || ({v} != {v} && {acc} == {acc})" if t.is_float else ""
        return f"({v} {cmp} {acc}{nan})"

    def arg_tie(self, t: DataType, v: str, acc: str) -> str:
        """Whether `v` and `acc` are equal for argmax/argmin (two NaNs are)."""
        nan = f" || ({v} != {v} && {acc} != {acc})" if t.is_float else ""
        return f"({v} == {acc}{nan})"


def template_source(kernels: Sequence[str], knobs: dict, hooks: str = "", ptx: Sequence[str] = ()) -> str:
    """The CUDA source of a template's program, in the one order every template uses: the
    prelude, the PTX wrappers it uses (`kiln.codegen.ptx`), the fusion hooks the core rendered
    for the task (`kiln.codegen.hooks`), its knobs as `#define NAME value` lines (a key may be a
    function-like macro, `"LOAD(v)"`), then its kernels and device functions, which read the
    knobs as macros."""
    head = "".join(f"#define {name} {value}\n" for name, value in knobs.items())
    return CUDA_PRELUDE + "".join(ptx) + hooks + head + "".join(kernels)

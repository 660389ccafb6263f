"""Staging GEMM operands for the tensor-core templates: any strides and any K.

The tensor-core kernels read each operand K-contiguous in 16-byte pieces, so they need every row
to start 16 bytes apart from the next (K and the strides multiples of eight 16-bit elements).
An operand that is not so (an LM head's gradient over a vocabulary of 50,257 words, a row-major
[K, N] weight, a strided view) is first copied by a small kernel (`cuda/stage.cuh`) into a
temporary [batch, X, Kp], K-contiguous, with Kp = K rounded up to eight and zeros past K; where
K itself is not a multiple of eight both operands are staged, so the padded products add zero.
The GEMM then reads the temporary as an ordinary aligned operand of reduction length Kp.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import Contraction, KernelArgs, Launch, Operand, as_dim, device_code

KERNEL = """
extern "C" __global__ void __launch_bounds__(256) {name}(const uint16_t* __restrict__ src,
                                                       uint16_t* __restrict__ dst{size_params}) {{
    const int64_t z = blockIdx.z;
    kiln::stage::k_major(src + ({batch}), dst + z * (int64_t)({x}) * ({kp}),
                         kiln::stage::Operand{{{x}, {k}, {kp}, {x_stride}, {k_stride}}});
}}
"""


def padded_k(c: Contraction):
    """The reduction length the GEMM runs over: K, rounded up to eight when it is not a multiple."""
    return (c.K + 7) // 8 * 8


def needed(c: Contraction, operand: Operand) -> bool:
    """Whether `operand` must be staged: K not a multiple of eight, or the operand not read
    K-contiguous from 16-byte aligned rows."""
    return c.K % 8 != 0 or not (operand.k_contiguous and operand.strides_multiple_of(8))


@dataclass
class Staged:
    """An operand as the GEMM reads it: the kernel argument, its row stride and its batch offset
    (C text for the flat batch index `bz`); with the staging kernel's source and launch when it
    was staged."""

    arg: str
    x_stride: str
    batch: str
    source: str = ""
    launch: Launch | None = None


def stage(c: Contraction, operand: Operand, rows, name: str, temporaries: list) -> Staged:
    """`operand` (of `rows` rows: M for A, N for B) as the GEMM reads it, staged by a kernel
    called `name` into a temporary appended to `temporaries` when `needed`."""
    if not needed(c, operand):
        return Staged(operand.param, f"(int64_t){c.text(operand.x_stride)}", c.batch_offset(operand, "bz"))
    kp = padded_k(c)
    tmp = KernelArgs.temporary(len(temporaries))
    temporaries.append(((as_dim(c.batch_count), as_dim(rows), as_dim(kp)), operand.dtype))
    source = KERNEL.format(
        name=name, size_params="".join(f", {d}" for d in c.sizes.declarations()), batch=c.batch_offset(operand, "z"),
        x=c.text(rows), k=c.text(c.K), kp=c.text(kp), x_stride=c.text(operand.x_stride),
        k_stride=c.text(operand.k_stride))
    launch = Launch(name, (operand.param, tmp, *c.sizes.names), (32, 8, 1),
                    grid=(as_dim(-(-rows // 32)), as_dim(-(-kp // 32)), as_dim(c.batch_count)))
    return Staged(tmp, f"(int64_t){c.text(kp)}", f"bz * (int64_t){c.text(rows * kp)}",
                  device_code(__package__, "cuda/stage.cuh") + source, launch)

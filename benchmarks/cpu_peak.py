"""The float32 FMA peak of one core of this machine: what a GEMM-bound model's time is bounded by.

Compiles with gcc and runs, pinned to one core by the caller (`taskset -c 0`), a loop of twelve
independent chains of fused multiply-adds on the widest vectors the compiler is told of (AVX-512,
else AVX2), and prints GFLOP/s. A model whose time is its GEMMs cannot run faster than its
multiply-adds at this rate (issue 36: BERT's linear layers are 93% of its steps on the CPU).

    python benchmarks/cpu_peak.py [--isa avx512f|avx2] [--seconds 1]

The default ISA is the widest this CPU reports in /proc/cpuinfo (an AMD EPYC of Zen 3 has no
AVX-512: its program would die of an illegal instruction).
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

PROGRAM = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#if WIDE
typedef __m512 vec;
#define FMA _mm512_fmadd_ps
#define SET _mm512_set1_ps
#define LANES 16
#else
typedef __m256 vec;
#define FMA _mm256_fmadd_ps
#define SET _mm256_set1_ps
#define LANES 8
#endif
int main(int argc, char** argv) {
    const long rounds = atol(argv[1]);
    vec a[12], b = SET(1.0000001f), c = SET(1e-7f);
    for (int i = 0; i < 12; ++i) a[i] = SET((float)i);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long r = 0; r < rounds; ++r)
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) a[i] = FMA(a[i], b, c);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    float keep[LANES];
    for (int i = 1; i < 12; ++i) a[0] = a[0] + a[i];
    __builtin_memcpy(keep, &a[0], sizeof keep);
    const double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    printf("%.1f %g\n", rounds * 12.0 * 2 * LANES / s / 1e9, keep[0]);
    return 0;
}
"""


def peak_gflops(isa: str = "avx512f", seconds: float = 1.0) -> float:
    """GFLOP/s of float32 fused multiply-adds on one core with `isa`'s vectors."""
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "peak.c", Path(folder) / "peak"
        source.write_text(PROGRAM)
        wide = int(isa == "avx512f")
        subprocess.run(["gcc", "-O2", f"-m{isa}", "-mfma", f"-DWIDE={wide}", str(source), "-o", str(binary)],
                       check=True)
        rounds = int(seconds * 4e8)
        return float(subprocess.run([str(binary), str(rounds)], check=True, capture_output=True,
                                    text=True).stdout.split()[0])


def widest_isa() -> str:
    """`avx512f` where this CPU's flags list it, else `avx2`."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "avx2"
    return "avx512f" if "avx512f" in flags else "avx2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default=widest_isa(), choices=["avx512f", "avx2"])
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    print(f"{args.isa}: {peak_gflops(args.isa, args.seconds):.1f} GFLOP/s float32 on one core")


if __name__ == "__main__":
    main()

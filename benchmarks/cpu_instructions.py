"""Instructions of every CPU kernel of a Kiln-compiled model, counted by callgrind: a measure that
other processes on a shared machine do not disturb, where wall-clock times do.

For a model of `cpu_bench.py` (random weights, batch 1), compiled by Kiln, one forward pass is
run and each step's inputs are kept. Each distinct kernel is then built as a program of its own
(its C source and a main that loads those inputs and calls it, one OpenMP thread) and run under
`valgrind --tool=callgrind` once and three times; the difference over two is one call's count.
Valgrind has no AVX-512, so the kernels are built with -mno-avx512f (the AVX2 paths of the
templates): counts compare Kiln with Kiln, not with what runs on an AVX-512 host.

    python benchmarks/cpu_instructions.py [--cases bert llama] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from cpu_bench import CASES
from kernel_times import graph_runs
from kiln.runtime.cpu import FLAGS, compiler

MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
void {entry}({params});
static void* load(const char* path, long bytes) {{
    void* p = calloc(1, bytes + 64);
    FILE* f = fopen(path, "rb");
    if (bytes && fread(p, 1, bytes, f) != (size_t)bytes) exit(3);
    fclose(f);
    return p;
}}
int main(int argc, char** argv) {{
    omp_set_num_threads(1);
    int reps = atoi(argv[1]);
{buffers}
    for (int r = 0; r < reps; ++r) {entry}({args});
    return 0;
}}
"""


def kernel_calls(name: str) -> list[tuple]:
    """(compiled task, inputs, outputs) of each kernel call of one forward pass of model `name`."""
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    model.eval()
    compiled = torch.compile(model, backend="kiln")
    calls = []
    with torch.no_grad():
        compiled(*inputs)
        for graph, graph_inputs in graph_runs(lambda: compiled(*inputs)):
            original = [s.kernel for s in graph.steps]

            def keeping(kernel):
                def call(ins, outs):
                    calls.append((kernel, [t.clone() for t in ins], [t.clone() for t in outs]))
                    kernel(ins, outs)
                return call

            for step in graph.steps:
                object.__setattr__(step, "kernel", keeping(step.kernel))
            try:
                graph.run(graph_inputs)
            finally:
                for step, kernel in zip(graph.steps, original):
                    object.__setattr__(step, "kernel", kernel)
    return calls


def count(program, inputs, outputs, folder: Path) -> float:
    """Instructions of one call of CPU `program` on `inputs` (callgrind, AVX2 build)."""
    buffers = []
    sizes = {f"out{k}": t.numel() * t.element_size() for k, t in enumerate(outputs)}
    sizes["kiln_status"] = 16
    for k, t in enumerate(inputs):
        path = folder / f"in{k}.bin"
        path.write_bytes(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        buffers.append(f'    void* in{k} = load("{path}", {t.numel() * t.element_size()});')
    buffers += [f"    void* {name} = calloc(1, {size + 64});" for name, size in sizes.items()]
    used = [line for line in buffers if line.split("=")[0].split()[-1] in program.args]
    (folder / "kernel.c").write_text(program.source)
    (folder / "main.c").write_text(MAIN.format(entry=program.entry, params=", ".join("void*" for _ in program.args),
                                               buffers="\n".join(used), args=", ".join(program.args)))
    flags = [f for f in FLAGS if f not in ("-shared", "-fPIC")] + ["-mno-avx512f"]
    subprocess.run([compiler()[0], *flags, str(folder / "kernel.c"), str(folder / "main.c"), "-o",
                    str(folder / "run"), "-lm"], check=True)
    totals = []
    for reps in (1, 3):
        run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={folder}/cg.{reps}",
                              str(folder / "run"), str(reps)], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"callgrind failed on {program.entry}:\n{run.stderr[-2000:]}")
        totals.append(int(re.search(r"Collected : (\d+)", run.stderr).group(1)))
    return (totals[1] - totals[0]) / 2


def run_case(name: str) -> dict:
    kernels: dict[str, dict] = collections.OrderedDict()
    for compiled, ins, outs in kernel_calls(name):
        program, task = compiled.kernel.program, compiled.task
        key = hashlib.sha1((program.source + program.entry).encode()).hexdigest()
        row = kernels.setdefault(key, {"operator": task.attrs.get("anchor_operator", task.name),
                                       "shapes": [list(o.shape) for o in task.outputs], "calls": 0,
                                       "program": program, "inputs": ins, "outputs": outs})
        row["calls"] += 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, row in enumerate(kernels.values()):
            folder = Path(tmp) / str(k)
            folder.mkdir()
            each = count(row["program"], row["inputs"], row["outputs"], folder)
            rows.append({"operator": row["operator"], "shapes": row["shapes"], "calls": row["calls"],
                         "minstr_each": round(each / 1e6, 3), "minstr": round(each * row["calls"] / 1e6, 2)})
            print(f"  {row['operator']:<14} {str(row['shapes']):<38} x{row['calls']:<3} {each / 1e6:9.2f} M each",
                  flush=True)
    by_operator = collections.defaultdict(float)
    for r in rows:
        by_operator[r["operator"]] += r["minstr"]
    total = sum(by_operator.values())
    print(f"{name}: {total:.0f} M instructions in {sum(r['calls'] for r in rows)} kernel calls")
    for op, n in sorted(by_operator.items(), key=lambda kv: -kv[1]):
        print(f"  {n:10.1f} M  {op}")
    return {"case": name, "total_minstr": round(total, 1), "by_operator": dict(by_operator), "kernels": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["bert", "llama"], choices=[c for c in CASES if c != "matmul"])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    torch.set_num_threads(1)
    results = [run_case(name) for name in args.cases]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

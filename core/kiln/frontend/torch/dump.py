"""What `$KILN_DUMP_DIR` keeps of one compiled graph (see `kiln.log.dump_folder`).

    graph-NNN/fx_graph.py        the graph dynamo handed over, as Python
    graph-NNN/passes/            the FlowGraph before the passes and after each one
    graph-NNN/flow_graph.txt     the optimized FlowGraph that runs
    graph-NNN/kernels/KK_NAME.c  the source of each kernel (.cu for CUDA), in run order
    graph-NNN/memory_plan.txt    a table of each intermediate's workspace offset, size and lifetime

and `compile_summary.jsonl` beside the folders, one line per compile (`kiln.frontend.torch.summary`).
"""
from __future__ import annotations

from pathlib import Path

from torch.fx import GraphModule

from kiln.graph import FlowGraph
from kiln.runtime.compiled_graph import View
from kiln.runtime.cpu import CpuProgram
from kiln.table import format_table


def kernel_source(kernel) -> tuple[str, str] | None:
    """(source, file suffix) of a built kernel (a CompiledTask), None where it has none (a view
    step's, which runs nothing)."""
    program = getattr(getattr(kernel, "kernel", kernel), "program", None)
    if program is None or isinstance(program, View):
        return None
    return program.source, ".c" if isinstance(program, CpuProgram) else ".cu"


def memory_plan_text(compiled) -> str:
    """The memory plan of a CompiledGraph: per workspace, a table of its intermediates."""
    lines = [repr(compiled)]
    for device, plan in compiled.plans.items():
        lines.append(f"workspace on {device}: {plan.size} bytes")
        rows = []
        for slot, offset in sorted(plan.offsets.items(), key=lambda item: item[1]):
            buffer = compiled.buffers[slot]
            first, last = compiled.lifetimes[slot]
            rows.append((slot, offset, buffer.nbytes,
                         f"{str(buffer.dtype).replace('torch.', '')}{list(buffer.shape)}",
                         f"{first}..{last}"))
        lines.append(format_table(rows, ("slot", "offset", "bytes", "tensor", "steps"),
                                  align=("right", "right", "right", "left", "left"), indent="  "))
    return "\n".join(lines) + "\n"


def dump_compiled(folder: Path, gm: GraphModule, graph: FlowGraph) -> None:
    """Write the fx graph, the optimized graph, its kernels' sources and its memory plan."""
    (folder / "fx_graph.py").write_text(gm.code)
    (folder / "flow_graph.txt").write_text(f"{graph}\n")
    compiled = graph.compile()
    kernels = folder / "kernels"
    kernels.mkdir(exist_ok=True)
    for k, (node, step) in enumerate(zip(graph.nodes, compiled.steps)):
        found = kernel_source(step.kernel)
        if found is not None:
            (kernels / f"{k:03d}_{node.name}{found[1]}").write_text(found[0])
    (folder / "memory_plan.txt").write_text(memory_plan_text(compiled))

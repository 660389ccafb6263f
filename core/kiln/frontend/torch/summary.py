"""The summary of each graph Kiln compiles, for tools rather than eyes.

One JSON object per compile (a graph traced and built for one input signature), made of what
the compile's log tells (`kiln.log.CompileRecord`), is

- appended as one line to `$KILN_DUMP_DIR/compile_summary.jsonl`, when KILN_DUMP_DIR is set;
- logged to torch's structured trace (`TORCH_TRACE=folder`, read by tlparse) as the artifact
  `kiln_compile_summary`, under the compile id of the dynamo graph it came from.

Its fields:

    compile_id        dynamo's id of the graph's compile ('0/0'; AOTAutograd's forward and
                      backward graphs share their dynamo graph's), or null
    graph             this process's count of Kiln compiles, from 0
    dump              the graph's dump folder ('graph-000'), or null
    inputs            the inputs' dtypes and sizes ('float32[3, 5]'; constants included)
    fx_nodes          nodes of the fx graph; nodes_mapped: its calls, each mapped by a rule
    left_to_pytorch   the nodes of its dynamo graph that run in PyTorch (fallback_to_eager):
                      node, operator and reason each
    operators         Kiln operators traced; kernels: kernels after the graph passes
    kernel_cache      by kind of kernel ('cpu', 'cuda'), those taken from the on-disk cache
                      (hits) and those built (misses), tuning candidates and the NVRTC check
                      (KILN_NVRTC_CHECK) included; kernels_reused: kernels this process had
                      built already, taken without a cache lookup
    stages_ms         milliseconds of each stage (interpret, optimize, build)
    tuning            templates tuned (template, task, best knobs, best_ms, candidates, failed,
                      seconds) and tuning results reused from the cache
"""
from __future__ import annotations

import itertools
import json
import os

from torch._guards import CompileContext, compile_context
from torch._logging import trace_structured
from torch.fx import GraphModule, Node

from kiln.frontend.torch.errors import target_name
from kiln.frontend.torch.interpreter import Interpreter
from kiln.graph import FlowGraph
from kiln.log import CompileRecord, dump_root

FILE = "compile_summary.jsonl"
ARTIFACT = "kiln_compile_summary"

_graphs = itertools.count()


def left_to_pytorch(gm: GraphModule, reasons: dict[Node, str]) -> list[dict]:
    """The nodes of `gm` that run in PyTorch, each with its operator's name and the reason."""
    interpreter = Interpreter(gm)
    return [{"node": node.name, "operator": target_name(*interpreter.kind_and_target(node)),
             "reason": why} for node, why in reasons.items()]


def compile_summary(gm: GraphModule, compile_id, inputs: list[str], left: list[dict],
                    traced: FlowGraph, graph: FlowGraph, record: CompileRecord, dump) -> dict:
    """The summary of one compile of `gm` on `inputs` (see the module's docstring): `traced` is
    the FlowGraph the interpreter made, `graph` the one that runs, `dump` its folder or None."""
    return {
        "compile_id": None if compile_id is None else str(compile_id),
        "graph": next(_graphs),
        "dump": None if dump is None else dump.name,
        "inputs": inputs,
        "fx_nodes": len(gm.graph.nodes),
        "nodes_mapped": sum(n.op.startswith("call_") for n in gm.graph.nodes),
        "left_to_pytorch": left,
        "operators": len(traced.nodes),
        "kernels": len(graph.nodes),
        "kernel_cache": record.kernel_cache,
        "kernels_reused": record.kernels_reused,
        "stages_ms": {name: round(ms, 3) for name, ms in record.stages.items()},
        "tuning": {"templates": record.tuned, "results_reused": record.tuning_reused},
    }


def publish(summary: dict, compile_id) -> None:
    """Append `summary` to the dump folder's FILE (when dumping) and log it to torch's
    structured trace (when tracing)."""
    line = json.dumps(summary, default=str)
    root = dump_root()
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        # one write of the whole line, so that compiles appending at once never interleave
        fd = os.open(root / FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{line}\n".encode())
        finally:
            os.close(fd)
    # a graph is traced at its first call, after dynamo's compile: its id is given back here
    with compile_context(CompileContext(compile_id)):
        trace_structured("artifact", metadata_fn=lambda: {"name": ARTIFACT, "encoding": "json"},
                         payload_fn=lambda: line)

"""Each decoder layer's new keys and values stored by the kernel computing them on a GPU
(`kiln.passes.row_stores`, issue 31), as tests/frontend/test_store_rows_in_kernels.py checks on
the CPU: a 3-layer decode's logits and caches are eager's, and a layer's launches (3 layers'
less 2 layers') count no StoreRows launch and no write-back copy."""
from __future__ import annotations

import pytest
import torch

from kiln.graph.compile import is_view
from kiln.schedule.choose import choose
from tests.frontend import test_store_rows_in_kernels as cpu
from tests.frontend.in_place_support import in_place_outputs

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]

DEVICE = "cuda"


def _launches(run) -> int:
    """The kernel launches of one call of `run` and its write-back copies."""
    kernels = sum(len(choose(n.task, "cuda", 90).launches) for n in run.graph.nodes
                  if not is_view(n, run.graph) and not n.definition.name == "store_rows")
    stores = sum(1 for n in run.graph.nodes if n.definition.name == "store_rows")
    return kernels + stores + len(run.writeback) - len(in_place_outputs(run))


@pytest.mark.parametrize("family, dtype", [("llama", torch.bfloat16), ("qwen2", torch.bfloat16),
                                           ("qwen2", torch.float32)])
def test_decoding_on_a_gpu_stores_each_layers_rows_in_their_kernel(family, dtype):
    run = cpu.check_decoding(family, dtype, 10, DEVICE, layers=3)
    assert len(in_place_outputs(run)) == len(run.writeback), "nothing written back"


def test_a_layer_of_a_qwen2_decoding_step_is_nine_launches():
    """decode_bench's per-layer count: RMSNorm, QKV GEMV, the rows kernel (rotary, K/V rows
    stored into the caches), attention, O GEMV, RMSNorm, gate-up GEMV, SiLU-mul, down GEMV."""
    counts = [_launches(cpu.check_decoding("qwen2", torch.bfloat16, 64, DEVICE, layers=layers, steps=2))
              for layers in (2, 3)]
    assert counts[1] - counts[0] == 9

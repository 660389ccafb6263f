"""The Hopper engine's kernels for compute-sanitizer: every level-1 knob setting of gemm_sm90 (a
linear with a bias, a residual its epilogue stages by TMA, and a ReLU) and of conv_sm90 (a 3x3
convolution with a bias, in float16 and in float32 on TF32), launched once each on small odd
shapes and checked against torch.
Exits non-zero where a setting gives a wrong result. Run from the repository root:

    compute-sanitizer --tool racecheck --racecheck-report hazard python3 benchmarks/sanitize_knobs.py
    compute-sanitizer --tool memcheck python3 benchmarks/sanitize_knobs.py
"""
import sys

import torch

sys.path.insert(0, ".")
import kiln  # noqa: E402
from kiln.runtime.backend import backend_for
from kiln_ops_builtin.templates import conv_sm90, gemm_sm90
from tests.cuda.conv_support import channels_last_task, reference
from tests.cuda.test_epilogue_sources import _linear_residual
dev = kiln.device("cuda")
bad = 0
m, k, n = 200, 136, 144
task = _linear_residual(m, k, n)
x, w, b, r = (torch.randn(*s, device="cuda", dtype=torch.float16) for s in ((m, k), (n, k), (n,), (m, n)))
want = torch.relu(x.double() @ w.double().T + b.double() + r.double())
for knobs in gemm_sm90.TEMPLATE.space(1):
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    backend_for(dev).load(gemm_sm90.render(task, **knobs), dev)([x, w, b, r], [out])
    err = ((out.double() - want).norm() / want.norm()).item()
    bad += err > 1e-2
    print("gemm_sm90", knobs, f"err {err:.1e}", flush=True)
xs, ws, kw = (2, 13, 11, 16), (40, 3, 3, 16), {"stride": 1, "padding": 1}
for dtype, tf32 in ((torch.float16, {}), (torch.float32, {"allow_tf32": True})):
    xc, wc, bc = (torch.randn(*s).to(dtype) for s in (xs, ws, ws[:1]))
    task = channels_last_task((xc, wc, bc), {**kw, **tf32})
    want = reference(xc, wc, bc, kw).cuda()
    for knobs in conv_sm90.TEMPLATE.space(1):
        out = torch.empty(want.shape, device="cuda", dtype=dtype)
        backend_for(dev).load(conv_sm90.render(task, **knobs), dev)([xc.cuda(), wc.cuda(), bc.cuda()], [out])
        err = ((out.double() - want).norm() / want.norm()).item()
        bad += err > 1e-2
        print("conv_sm90", str(dtype)[6:], knobs, f"err {err:.1e}", flush=True)
print("settings with wrong results:", bad)
sys.exit(1 if bad else 0)

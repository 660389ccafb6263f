"""Every knob setting of every CUDA template (tuning level 1) that applies on this GPU, run
against PyTorch: matmul with tile edges, batched matmul with broadcasting, linear with bias,
convolutions as implicit GEMM, a depthwise convolution on channels-last data."""
import pytest
import torch

import kiln
from kiln.plugins.registry import registry
from tests.cuda.cases import conv2d_channels_last
from tests.support import assert_close, rand

pytestmark = pytest.mark.cuda

CALLS = {
    "matmul_edges": ("matmul", lambda dt: [rand((130, 72), dt), rand((72, 136), dt)], torch.matmul),
    "matmul_batched": ("matmul", lambda dt: [rand((2, 3, 70, 64), dt), rand((3, 64, 40), dt)], torch.matmul),
    "linear": ("linear", lambda dt: [rand((5, 7, 96), dt), rand((50, 96), dt), rand((50,), dt)],
               torch.nn.functional.linear),
    "conv2d_pad_stride": ("conv2d", lambda dt: [rand((2, 5, 17, 15), dt), rand((12, 5, 3, 3), dt), rand((12,), dt), 2, 1],
                          torch.nn.functional.conv2d),
    "conv_transpose2d": ("conv_transpose2d", lambda dt: [rand((2, 6, 7, 7), dt), rand((6, 4, 3, 3), dt), None, 2],
                         torch.nn.functional.conv_transpose2d),
    "depthwise_channels_last": ("conv2d_channels_last", lambda dt: [rand((2, 9, 7, 24), dt), rand((24, 5, 5, 1), dt),
                                                                    rand((24,), dt), 2, 2, 1, 24], conv2d_channels_last),
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _programs():
    from kiln.schedule import schedules_for
    for call, (op, make, _) in CALLS.items():
        for dtype in DTYPES:
            definition = registry().operator(op)
            args = [kiln.from_torch(t) if isinstance(t, torch.Tensor) else t for t in make(dtype)]
            task = definition.task(definition.bind(args, {}))[0]
            for template in schedules_for(task, "cuda"):
                for knobs in template.space(1):
                    yield pytest.param(call, dtype, template, knobs,
                                       id=f"{template.name}-{call}-{str(dtype)[6:]}-{'-'.join(map(str, knobs.values()))}")


@pytest.mark.parametrize("call,dtype,template,knobs", list(_programs()))
def test_template_matches_torch(call, dtype, template, knobs):
    from kiln.runtime.cuda import arch_number, device_info
    from kiln.runtime.backend import backend_for
    if template.min_arch > arch_number(device_info(0)["arch"]):
        pytest.skip(f"{template.name} needs sm_{template.min_arch}")
    op, make, reference = CALLS[call]
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in make(dtype)]
    inputs = [t for t in args if isinstance(t, torch.Tensor)]
    definition = registry().operator(op)
    task = definition.task(definition.bind([kiln.from_torch(t) if isinstance(t, torch.Tensor) else t for t in args], {}))[0]
    runner = backend_for(kiln.device("cuda")).load(template.render(task, **knobs), kiln.device("cuda"))
    out = torch.full(task.outputs[0].shape, float("nan"), dtype=dtype, device="cuda")
    runner(inputs, [out])
    expected = reference(*[t.double() if isinstance(t, torch.Tensor) else t for t in args]).to(dtype)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    assert_close(out, expected, atol=tol, rtol=tol)

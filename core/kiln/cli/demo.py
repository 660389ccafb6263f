"""Kiln's quick start on one device: tensors, operators run imperatively, a flow graph
traced from symbolic tensors, printed and run, and a small model through
torch.compile(backend="kiln") with its correctness report and eager vs Kiln time.

Each step prints the code it runs and its result; the demo ends by checking the graph's result
against the imperative one and against PyTorch, and the compiled model against eager.
"""
from __future__ import annotations

HELP = "run the quick-start flow: tensors, operators, a flow graph, a model via torch.compile"


def configure(parser) -> None:
    parser.add_argument("--device", default=None,
                        help="device to run on (default: cuda when present, else cpu)")


def step(title: str, code: str, *results) -> None:
    """Print one step of the demo: a title, the code it ran, then its results."""
    print(f"\n== {title}")
    print("\n".join(f">>> {line}" for line in code.strip().splitlines()))
    for r in results:
        print(r)


def run(args) -> int:
    import torch

    import kiln

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a = kiln.randn([2, 3], device=args.device)
    step("Define tensors", "a = kiln.randn([2, 3])\nprint(a)", a)

    b = kiln.randn([3, 2], device=args.device)
    c = kiln.randn([2], device=args.device)
    d = kiln.ops.matmul(a, b) + c
    step("Run operators imperatively",
         "b = kiln.randn([3, 2])\nc = kiln.randn([2])\nd = kiln.ops.matmul(a, b) + c\nprint(d)", d)

    x = kiln.symbol_like(a)
    y = kiln.ops.matmul(x, b) + c
    step("Symbolic tensors", "x = kiln.symbol_like(a)\ny = kiln.ops.matmul(x, b) + c\n"
         "print('x:', x)\nprint('y:', y)", f"x: {x}", f"y: {y}")

    graph = kiln.trace_from(y, inputs=[x])
    step("Trace a flow graph", "graph = kiln.trace_from(y, inputs=[x])\nprint(graph)", graph)

    y1 = graph(a)
    step("Run the flow graph", "y1 = graph(a)\nprint(y1)", y1)

    expected = a.torch() @ b.torch() + c.torch()
    ok = (torch.allclose(y1.torch(), d.torch(), rtol=1e-5, atol=1e-5)
          and torch.allclose(y1.torch(), expected, rtol=1e-4, atol=1e-4))
    print(f"\nflow graph == imperative == PyTorch: {ok}")
    model_ok = compile_model(args.device)
    return 0 if ok and model_ok else 1


def _median_ms(fn, x, repeats: int = 20) -> float:
    import time

    import torch

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def compile_model(device: str) -> bool:
    """Compile a small residual CNN through torch.compile(backend="kiln") with the correctness
    report on; print eager vs Kiln latency; return whether Kiln matches eager."""
    import torch
    from torch import nn

    import kiln

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                      nn.ReLU(), nn.Conv2d(c, c, 3, padding=1, bias=False),
                                      nn.BatchNorm2d(c))

        def forward(self, x):
            return torch.relu(self.body(x) + x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), Block(16),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).to(device).eval()
    x = torch.randn(8, 3, 32, 32, device=device)
    step("Compile a model with torch.compile", """
kiln.torch.dynamo_config.correctness_report()
model_opt = torch.compile(model, backend="kiln")
y = model_opt(x)""")
    kiln.torch.dynamo_config.correctness_report()
    try:
        with torch.no_grad():
            model_opt = torch.compile(model, backend="kiln")
            y = model_opt(x)
    finally:
        kiln.torch.dynamo_config.correctness_report(False)
    with torch.no_grad():
        expected = model(x)
        eager, compiled = _median_ms(model, x), _median_ms(model_opt, x)
    ok = torch.allclose(y, expected, rtol=1e-3, atol=1e-3)
    print(f"\neager: {eager:.3f} ms   kiln: {compiled:.3f} ms   ({eager / compiled:.2f}x) on {device}")
    print(f"torch.compile(backend='kiln') == eager: {ok}")
    return ok

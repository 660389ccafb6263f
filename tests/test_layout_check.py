"""`kiln.runtime.cuda_graph.layout_check`: the C check a CUDA graph's replay makes of its inputs
before its Python checks (which run only where it fails). It must accept only tensors of the
examples' sizes, strides, dtypes and devices, and never raise."""
import torch

from kiln.runtime.cuda_graph import layout_check


def test_accepts_the_examples_layouts_and_nothing_else():
    examples = [torch.randn(4, 6), torch.randn(6, 4).t(), torch.zeros(3, dtype=torch.int64), torch.randn(())]
    check = layout_check(examples)
    assert check([t.clone() if t.is_contiguous() else t.clone().t().contiguous().t() for t in examples])
    assert check(examples)
    others = {
        "shape": [torch.randn(4, 7), *examples[1:]],
        "stride": [examples[0], torch.randn(4, 6), *examples[2:]],
        "dtype": [examples[0], examples[1], torch.zeros(3, dtype=torch.int32), examples[3]],
        "requires_grad": [examples[0].clone().requires_grad_(), *examples[1:]],
        "fewer": examples[:3],
        "more": examples + [torch.randn(1)],
        "not a tensor": [examples[0], examples[1], [0, 0, 0], examples[3]],
    }
    for what, tensors in others.items():
        assert check(tensors) is False, what


def test_without_examples_it_checks_the_empty_sequence():
    check = layout_check([])
    assert check([]) and not check([torch.randn(1)])

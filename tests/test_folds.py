"""Folded tensors (`kiln.runtime.folds`): a kernel run at compile time is recorded, not counted
as a read of its inputs' values; a fold plan computes its outputs again from other tensors."""
from __future__ import annotations

import gc

import torch

import kiln
from kiln.runtime import folds
from kiln.tensor import recording_reads


def _relu_plus(x, y):
    return kiln.ops.relu(kiln.from_torch(x)) + kiln.from_torch(y)


def test_a_fold_plan_computes_a_folded_tensor_again_from_other_arguments():
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    s = _relu_plus(a, b).torch()
    assert {id(t) for t in folds.sources(s)} == {id(a), id(b)} and folds.sources(a) == []
    plan = folds.fold_plan({7: s, 8: a}, {id(a): 0, id(b): 1})
    assert plan.slots == [7] and plan.arguments == [0, 1] and not plan.plan.constants
    a2, b2 = torch.randn(5, 3), torch.randn(5, 3)
    torch.testing.assert_close(plan.computed([a2, b2])[7], a2.relu() + b2)


def test_a_source_that_is_no_argument_is_held_by_the_plan():
    a, b = torch.randn(4), torch.randn(4)
    s = _relu_plus(a, b).torch()
    plan = folds.fold_plan({0: s}, {id(a): 0})
    assert [t is b for t in plan.plan.constants.values()] == [True]
    a2 = torch.randn(4)
    torch.testing.assert_close(plan.computed([a2])[0], a2.relu() + b)


def test_a_folded_tensor_made_from_a_tensor_that_is_gone_is_left_out():
    a = torch.randn(4)
    s = _relu_plus(a, torch.randn(4)).torch()
    gc.collect()
    assert folds.sources(s) == [a]
    assert folds.fold_plan({0: s}, {id(a): 0}) is None


def test_a_kernel_run_reads_no_values_and_reading_a_folded_tensor_reads_its_sources():
    a, b = torch.randn(6), torch.randn(6)
    with recording_reads() as reads:
        s = _relu_plus(a, b)
    assert id(a) not in reads and id(b) not in reads
    with recording_reads() as reads:
        s.torch()
    assert {id(a), id(b), id(s.storage)} <= reads

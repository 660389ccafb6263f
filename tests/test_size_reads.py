"""What a computation reads of symbolic sizes' values (`kiln.ir.size_reads`): comparisons are
kept as guards that answer again at other sizes, any other read of a value marks the record,
caches keep a recording's entries apart; a plan's sizes bind to other values
(`kiln.runtime.plan_binding`)."""
import dataclasses
import math

import pytest
import torch

from kiln.graph.operator import Recent
from kiln.ir import SizeVar, SymSize
from kiln.ir.size import distinct, guard_variables, guards_hold, value_at, variables
from kiln.ir.size_reads import current, note_check, recording
from kiln.runtime.compiled_graph import Buffer
from kiln.runtime.cuda import Launch
from kiln.runtime.plan import Plan
from kiln.runtime.plan_binding import binds_elsewhere, bound, symbolic_parts


def test_comparisons_are_guards_that_answer_again_at_other_sizes():
    s, t = SymSize.named("s0", 96), SymSize.named("s1", 7)
    with recording() as reads:
        assert s * 4 >= 256 and not s % 8 and s != t and max(s, 64) is s
    assert reads.read is None
    assert guards_hold(reads.guards, {"s0": 96, "s1": 7})
    assert guards_hold(reads.guards, {"s0": 200, "s1": 3})
    assert not guards_hold(reads.guards, {"s0": 60, "s1": 7})      # s0 * 4 >= 256 flips
    assert not guards_hold(reads.guards, {"s0": 100, "s1": 7})     # s0 % 8 == 0 flips
    assert not guards_hold(reads.guards, {"s0": 96, "s1": 96})     # s0 != s1 flips


def test_a_check_is_a_guard_that_computes_again_at_other_sizes():
    """A decision on values computed from sizes (`note_check`) holds where its check says so,
    with the comparisons, and names the variables it reads."""
    s = SymSize.named("s0", 12)
    asked = []

    def check(values):
        asked.append(values["s0"])
        return values["s0"] % 3 == 0
    with recording() as reads:
        assert s > 4
        note_check(check, {"s0"})
    assert reads.read is None
    assert guards_hold(reads.guards, {"s0": 9}) and not guards_hold(reads.guards, {"s0": 10})
    assert not guards_hold(reads.guards, {"s0": 3}) and asked == [9, 10]     # comparisons first: 3 is not > 4
    assert set().union(*map(guard_variables, reads.guards)) == {"s0"}


@pytest.mark.parametrize("read", [int, float, hash, str, format, lambda s: s / 2, lambda s: s & 1,
                                  lambda s: s < 2.5, lambda s: s.bit_length(), lambda s: divmod(s, 3),
                                  lambda s: SizeVar("s0", 96).value],
                         ids=["int", "float", "hash", "str", "format", "truediv", "and", "float-compare",
                              "bit_length", "divmod", "SizeVar.value"])
def test_any_other_read_of_a_value_marks_the_record(read):
    with recording() as reads:
        read(SymSize.named("s0", 96))
    assert reads.read is not None and __file__ in reads.read


def test_arithmetic_distinct_sizes_and_keys_read_no_value():
    s = SymSize.named("s0", 96)
    with recording() as reads:
        n = math.prod((s, 3, s // 2)) - s % 5 + (-s)
        assert value_at(n, {"s0": 10}) == 10 * 3 * 5 - 0 - 10
        assert variables((s * 3 + SymSize.named("s1", 7) // s).polynomial) == {"s0": 96, "s1": 7}
        assert distinct([s, 96, s * 1, 3]) == [s, 3]
        SizeVar("s0", s).key()
        assert s != None and s != "s0"      # noqa: E711: comparing with what is not a number
    assert reads.read is None
    assert current() is None


def test_a_recording_sees_only_the_cache_entries_it_put():
    cache = Recent(lambda: 4)
    cache.put("outside", 1)
    with recording():
        assert cache.get("outside") is None
        cache.put("inside", 2)
        assert cache.get("inside") == 2
    assert cache.get("inside") is None and cache.get("outside") == 1


def test_a_plan_binds_its_sizes_to_other_values():
    s = SymSize.named("s0", 96)
    launch = Launch("k", ("in0", "out0"), (256, 1, 1), grid=(s * 2 // 64 + 1, 1, 1), items=s)
    plan = Plan([((launch,), "cuda")], [((0,), (1,))], [Buffer((s, 64), torch.float32, torch.device("cpu")),
                                                        Buffer((s, 64), torch.float32, torch.device("cpu"))],
                [0], [1], {})
    at_200 = bound(plan, {"s0": 200}, symbolic_parts(plan))
    assert at_200.buffers[0].shape == (200, 64) and type(at_200.buffers[0].shape[0]) is int
    assert at_200.kernels[0][0][0] == dataclasses.replace(launch, grid=(7, 1, 1), items=200)
    assert bound(plan, None) == bound(plan, {"s0": 96})
    assert binds_elsewhere(plan)
    with_constant = dataclasses.replace(plan, constants={1: torch.zeros(96, 64)})
    assert not binds_elsewhere(with_constant)

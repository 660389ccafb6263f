"""Fusion's cycle check (`kiln.passes.fusion._Groups.merge`) searches only between the two
groups' places in a topological order of the groups that each merge keeps one (Pearce and
Kelly's dynamic order): on random graphs of element-wise operators, random merges take the
same decisions as a search of the whole graph, and the order stays topological."""
import random

import pytest

import kiln
from kiln.passes.fusion import _Groups

ops = kiln.ops


def random_graph(seed: int, size: int):
    """A graph of `size` additions and multiplications of random earlier values."""
    rng = random.Random(seed)
    x = kiln.symbol([4])
    values = [x]
    for _ in range(size):
        a, b = rng.choice(values[-6:]), rng.choice(values)
        values.append((ops.add if rng.random() < 0.5 else ops.mul)(a, b))
    return kiln.trace_from(values[-3:], [x]), rng


def links(groups: _Groups) -> dict[int, set[int]]:
    """Each group's successors, found from the nodes afresh."""
    return {g: {groups.group[id(u)] for n in members for t in n.outputs for u in groups.users.get(id(t), ())} - {g}
            for g, members in groups.members.items()}


def makes_cycle(succ: dict[int, set[int]], a: int, b: int) -> bool:
    """Whether a path leads from a to b, or from b to a, through another group."""
    def reaches(start, target):
        seen, todo = set(start), list(start)
        while todo:
            g = todo.pop()
            if g == target:
                return True
            for s in succ[g] - seen:
                seen.add(s)
                todo.append(s)
        return False
    return reaches(succ[a] - {b}, b) or reaches(succ[b] - {a}, a)


@pytest.mark.parametrize("seed", range(8))
def test_merges_match_a_search_of_the_whole_graph(seed):
    graph, rng = random_graph(seed, 60)
    groups = _Groups(graph, None)
    refused = 0
    for _ in range(300):
        if len(groups.members) < 2:
            break
        a, b = rng.sample(sorted(groups.members), 2)
        succ = links(groups)
        expected = not makes_cycle(succ, a, b)
        assert groups.merge(a, b) == expected
        refused += not expected
        succ = links(groups)
        assert {g: groups.successors(g) for g in succ} == succ
        assert all(groups.position[g] < groups.position[s] for g in succ for s in succ[g])
        assert {g: groups.predecessors(g) for g in succ} == {g: {p for p in succ if g in succ[p]} for g in succ}
    assert refused > 0

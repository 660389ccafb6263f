"""Operator fusion: injective operators join their neighbours, so each group is one kernel.

An *anchor* is an operator whose task reduces (matmul, conv2d, softmax, ...); every other
operator is injective, whether or not a schedule template takes it alone: an element-wise
operator that a plugin gives a template of its own fuses with its element-wise neighbours as
any other does, into one auto-scheduled kernel (the template runs it where it stays alone).
Which templates would schedule a task the pass asks its compile session
(`kiln.schedule.CompileSession`: `ctx.session`), once per task. Groups grow from single nodes:

- epilogue: an injective node joins the group producing one of its inputs, where that input
  has no other user and is not a graph output; then, likewise, an anchor-free group joins the
  group producing an input that only its members read (a chain that fans out from the input and
  meets again, such as GELU written out; a sum of several values whose first addition grouped
  apart, such as a residual stream's R + A + F after F's linear); but a view of an anchor-free
  group's result that a template would read through waits for the prologue step (the transpose
  of a weight's bfloat16 cast before a linear: the cast is written as the weight lies);
- prologue: an injective node joins the group that uses all of its outputs (none of them a
  graph output), unless that group's anchor is template-scheduled, the node computes anything
  and the anchor reads it (a view, such as the slices and head permutes before attention, joins
  where the template reads views: `Template.reads_views`; what only the epilogue reads, such as
  the residual a linear's result is added to, joins the epilogue);
- rows: a reduction's group joins the group reading it, a reduction group or an anchor-free
  one, where the two make one row task (a hand-written softmax or layer_norm; a normalization
  whose statistics are outputs too, as training saves them; see `_Groups.fuse_row_reductions`);
  then prologues again, for producers whose readers the rows gathered into one group.

A group never gets two anchors (but as one row task), never a cycle through another group, never
the computation of the input of an operator that `compares_elements` (`kiln.graph.Traits`),
and a node does not join a group whose anchor's best schedule template would take the anchor
alone but not the group (templates read plain inputs and render epilogues through their hooks: see
`kiln.codegen.hooks`); it may join another group instead (a chunk of a matmul's result, say,
with the element-wise operators after it). Element-wise chains without an anchor become one
auto-scheduled kernel; groups with one become `FusedOperator`s recording their (first) anchor.
"""
from __future__ import annotations

from collections import deque

from kiln.graph import Operator, trace_from
from kiln.ir.expr import Load
from kiln.ir.inline import inline_task
from kiln.passes.edit import reapply, users
from kiln.passes.fused import FusedOperator
from kiln.passes.graph_pass import GraphPass
from kiln.schedule.rows import row_task
from kiln.schedule.session import CompileSession


def is_anchor(node: Operator) -> bool:
    """Whether `node` is a reduction (or an existing group): what a group is built around."""
    return isinstance(node, FusedOperator) or not node.task.is_injective


def keeps_templates(anchor: Operator, fused: FusedOperator, session: CompileSession) -> bool:
    """False where a template would schedule the anchor alone but does not take the fused task:
    fusion never trades a kernel for a slower template's (a float16 GEMM's tensor-core engine
    for the SIMT one, say)."""
    best = session.template(anchor.task, anchor.device)
    return best is None or best in session.templates(fused.task, anchor.device)


def moves_data(node: Operator) -> bool:
    """Whether `node` only moves data: each element of each output is an input element (a view,
    or the parts of a split); found once for each task."""
    return node.task.derived(_moves_data)


def _moves_data(task) -> bool:
    lowered = inline_task(task)
    return not lowered.temporaries and all(isinstance(b.value, Load) for b in lowered.buffers)


def _is_row_task(task) -> bool:
    return row_task(inline_task(task)) is not None


class _Groups:
    """Union of node groups over a graph, with the checks that keep a merge legal."""

    def __init__(self, graph, session: CompileSession):
        self.session = session
        self.nodes = graph.nodes
        self.index = {id(n): k for k, n in enumerate(self.nodes)}
        self.users = users(graph)
        self.outputs = {id(t) for t in graph.outputs}
        self.producer = {id(t): n for n in self.nodes for t in n.outputs}
        self.group = {id(n): k for k, n in enumerate(self.nodes)}
        self.members = {k: [n] for k, n in enumerate(self.nodes)}
        self.anchor_nodes = {id(n) for n in self.nodes if is_anchor(n)}
        # anchors whose operator has templates on its target: they read their inputs plain
        self.templated = {self.group[id(n)] for n in self.nodes if id(n) in self.anchor_nodes
                          and session.contributed(n.definition.name, n.device.kind)}
        self.anchors = {k: int(id(n) in self.anchor_nodes) for k, n in enumerate(self.nodes)}
        self.frozen = {self.group[id(n)] for n in self.nodes if isinstance(n, FusedOperator)}
        self._successors: dict[int, set[int]] = {}
        self._predecessors: dict[int, set[int]] = {}
        # a topological order of the groups (the nodes' to begin with), kept one through merges
        # (`_reorder`): a path between two groups visits only groups placed between them
        self.position = {k: k for k in range(len(self.nodes))}
        self._fused: dict[frozenset, FusedOperator | None] = {}     # `fused`'s answers, by member set

    def reads_views(self, g: int) -> bool:
        """Whether the best template of group g's anchor reads views fused before it."""
        anchor = next((n for n in self.members[g] if id(n) in self.anchor_nodes), None)
        best = (None if anchor is None or isinstance(anchor, FusedOperator)
                else self.session.template(anchor.task, anchor.device))
        return bool(getattr(best, "reads_views", False))

    def successors(self, g: int) -> set[int]:
        """The groups reading an output of group g's members (kept until a merge changes them)."""
        if g not in self._successors:
            self._successors[g] = {self.group[id(u)] for n in self.members[g] for t in n.outputs
                                   for u in self.users.get(id(t), ())} - {g}
        return self._successors[g]

    def predecessors(self, g: int) -> set[int]:
        """The groups producing an input of group g's members (kept until a merge changes them)."""
        if g not in self._predecessors:
            self._predecessors[g] = {self.group[id(p)] for n in self.members[g] for t in n.inputs
                                     if (p := self.producer.get(id(t))) is not None} - {g}
        return self._predecessors[g]

    def _relink(self, a: int, b: int, writers: set[int], readers: set[int]) -> None:
        """The kept successor and predecessor sets, group b (reading `writers`, read by
        `readers`) having joined group a: a's found again, b read as a in its neighbours'."""
        for kept in (self._successors, self._predecessors):
            kept.pop(a, None)
            kept.pop(b, None)
        neighbours = [(g, self._successors.get(g)) for g in writers] + [(g, self._predecessors.get(g)) for g in readers]
        for g, kept in neighbours:
            if kept is not None and g != a:
                kept.discard(b)
                kept.add(a)

    def _placed_between(self, first: int, last: int) -> set[int] | None:
        """The groups that group `first` reaches and that are placed before group `last` (placed
        after `first`), or None where one of them reaches `last`: merging the two would make a
        cycle through another group."""
        bound = self.position[last]
        found = {s for s in self.successors(first) if s != last and self.position[s] < bound}
        todo = list(found)
        while todo:
            for s in self.successors(todo.pop()):
                if s == last:
                    return None
                if s not in found and self.position[s] < bound:
                    found.add(s)
                    todo.append(s)
        return found

    def _reorder(self, first: int, last: int, merged: int, after: set[int]) -> None:
        """Place the group `merged` that groups `first` and `last` become (`last` placed after
        `first`; `after` the groups between them that `first` reaches: `_placed_between`) so that
        the order stays topological: the groups between them that reach `last`, then the merged
        group, then `after`, each kept in its order, take the places they held (Pearce and
        Kelly's dynamic topological order)."""
        bound = self.position[first]
        before = {p for p in self.predecessors(last) if p != first and self.position[p] > bound}
        todo = list(before)
        while todo:
            for p in self.predecessors(todo.pop()):
                if p not in before and self.position[p] > bound:
                    before.add(p)
                    todo.append(p)
        places = sorted([self.position[g] for g in before | after] + [bound, self.position[last]])
        del places[len(before) + 1]
        moved = sorted(before, key=self.position.get) + [merged] + sorted(after, key=self.position.get)
        del self.position[first], self.position[last]
        self.position.update(zip(moved, places))

    def merge(self, a: int, b: int, rows: bool = False) -> bool:
        """Merge groups a and b if the result has no cycle and at most one anchor (or, with
        `rows`, is one row task: see `fuse_row_reductions`), and keeps its anchor's template
        where it has one."""
        if (a == b or a in self.frozen or b in self.frozen
                or (not rows and self.anchors[a] + self.anchors[b] > 1)):
            return False
        # no path leads from the group placed later to the other
        first, last = sorted((a, b), key=self.position.get)
        after = self._placed_between(first, last)
        if after is None:
            return False
        if (a in self.templated or b in self.templated) and self.fused(self.members[a] + self.members[b]) is None:
            return False
        if self.computes_compared(self.members[a] + self.members[b]):
            return False
        if rows and not self.is_row_task(self.members[a] + self.members[b]):
            return False
        self._reorder(first, last, a, after)
        writers, readers = self.predecessors(b), self.successors(b)
        for n in self.members[b]:
            self.group[id(n)] = a
        self._relink(a, b, writers, readers)
        self.members[a] += self.members.pop(b)
        self.anchors[a] += self.anchors.pop(b)
        if b in self.templated:
            self.templated.add(a)
        return True

    def computes_compared(self, members: list) -> bool:
        """Whether one of `members` computes (through views) the first input of another whose
        operator `compares_elements` (`kiln.graph.Traits`): that input is computed apart."""
        inside = {id(n) for n in members}
        for node in members:
            if isinstance(node, FusedOperator) or not node.definition.traits.compares_elements:
                continue
            todo = [self.producer.get(id(node.inputs[0]))] if node.inputs else []
            while todo:
                p = todo.pop()
                if p is None or id(p) not in inside:
                    continue
                if not moves_data(p):
                    return True
                todo.extend(self.producer.get(id(t)) for t in p.inputs)
        return False

    def fuse_epilogues(self) -> None:
        """Each injective node joins the group producing an input only it reads, but a view
        that a template reads through (`left_to_prologue`), a template-scheduled group's first:
        a bias added to a 16-bit matmul joins the matmul's epilogue, which rounds the sum once,
        rather than the bias's cast, after which a split would keep the two apart (GPT-2's
        fused q, k, v projection)."""
        for node in self.nodes:
            if id(node) in self.anchor_nodes:
                continue
            for t in sorted(node.inputs, key=lambda t: not self.templated_result(t)):
                p = self.producer.get(id(t))
                if (p is not None and id(t) not in self.outputs
                        and self.users[id(t)] == [node]
                        and not self.left_to_prologue(p, [node])
                        and self.merge(self.group[id(p)], self.group[id(node)])):
                    break

    def templated_result(self, t) -> bool:
        """Whether a template-scheduled group computes `t`."""
        p = self.producer.get(id(t))
        return p is not None and self.group[id(p)] in self.templated

    def left_to_prologue(self, producer: Operator, members: list[Operator]) -> bool:
        """Whether `members` are one view of what an anchor-free group (`producer`'s) computes,
        whose readers are all one group, whose anchor's template reads views and takes the view as
        its prologue: the transpose of a weight's cast to bfloat16 before a linear is then read
        by the GEMM as it lies, the cast written in the weight's layout, instead of the cast
        writing the transpose (a strided copy) for the GEMM to read."""
        if len(members) != 1 or self.anchors[self.group[id(producer)]] or not moves_data(members[0]):
            return False
        c = self.reading_group(members[0])
        return (c is not None and c in self.templated and self.reads_views(c)
                and self.fused(self.members[c] + members) is not None)

    def reading_group(self, node: Operator) -> int | None:
        """The one group, besides `node`'s own, that reads `node`'s outputs, where none of them is
        a graph output; else None."""
        if any(id(t) in self.outputs for t in node.outputs):
            return None
        readers = {self.group[id(u)] for t in node.outputs for u in self.users.get(id(t), ())}
        readers.discard(self.group[id(node)])
        return next(iter(readers)) if len(readers) == 1 else None

    def fuse_group_epilogues(self) -> None:
        """Each anchor-free group joins the group producing an input that only its members read,
        but a view that a template reads through (`left_to_prologue`)."""
        for g in list(self.members):
            if g not in self.members or self.anchors[g] or g in self.frozen:
                continue
            inside = {id(n) for n in self.members[g]}
            for t in {id(t): t for n in self.members[g] for t in n.inputs}.values():
                p = self.producer.get(id(t))
                if (p is not None and id(p) not in inside and id(t) not in self.outputs
                        and all(id(u) in inside for u in self.users[id(t)])
                        and not self.left_to_prologue(p, self.members[g])
                        and self.merge(self.group[id(p)], g)):
                    break

    def fuse_prologues(self) -> None:
        """Each anchor-free group joins the one group that reads all outputs of its last node,
        unless that group's anchor is template-scheduled (templates read plain operands), reads
        them and the group computes anything: views (slices, reshapes, permutes) are index
        arithmetic that a template declaring `reads_views` reads through, where it still takes
        the group; the template's epilogue computes what only it reads. A row task of several
        reductions (`fuse_row_reductions`) takes a prologue that leaves it one."""
        for node in reversed(self.nodes):
            g = self.group[id(node)]
            c = None if self.anchors[g] else self.reading_group(node)
            if c is None:
                continue
            readers = {id(u) for t in node.outputs for u in self.users.get(id(t), ())}
            if (c not in self.templated or readers <= self.epilogue(c)
                    or self.reads_views(c) and all(map(moves_data, self.members[g]))):
                self.merge(c, g, rows=self.anchors[c] > 1)

    def epilogue(self, g: int) -> set[int]:
        """The ids of group g's nodes that read its anchor's result (directly or through each
        other): its epilogue."""
        inside = {id(n) for n in self.members[g]}
        found, todo = set(), [n for n in self.members[g] if id(n) in self.anchor_nodes]
        while todo:
            for t in todo.pop().outputs:
                for u in self.users.get(id(t), ()):
                    if id(u) in inside and id(u) not in found:
                        found.add(id(u))
                        todo.append(u)
        return found

    def fuse_row_reductions(self) -> None:
        """A reduction group joins the group that reads its output, a reduction group or an
        anchor-free one, where together they are one row task (`kiln.schedule.rows`: every
        reduction a statistic of the output's rows, the statistics used outside written too):
        a softmax or layer_norm written out by hand (max, exp, sum, divide; mean, deviation,
        mean of squares, normalize) becomes one kernel computing each statistic once per row,
        instead of one kernel per reduction with intermediates in memory; so does a
        normalization whose statistics are saved for the backward (the normalized rows, read
        after a statistic that is an output too, join the statistic's group)."""
        def reduces(g: int) -> bool:
            return self.anchors.get(g, 0) > 0 and g not in self.templated and g not in self.frozen

        def joins(g: int) -> bool:
            return reduces(g) or (self.anchors.get(g, 0) == 0 and g not in self.frozen)

        merged = True
        while merged:
            merged = False
            for g in list(self.members):
                if g in self.members and reduces(g):
                    if any(joins(s) and self.merge(g, s, rows=True) for s in sorted(self.successors(g))):
                        merged = True

    def is_row_task(self, members: list[Operator]) -> bool:
        """Whether `members` fused are one row task (one row output, each reduction and each
        further output a row statistic)."""
        fused = self.fused(members)
        return fused is not None and fused.task.derived(_is_row_task)

    def fused(self, members: list[Operator]) -> FusedOperator | None:
        """The FusedOperator of `members` (in any order), or None where fusing would cost the
        anchor its template; built once for each set of members (`left_to_prologue` asks it of
        the group that the prologue step's merge asks it of again, and every merge of the group
        the pass then builds)."""
        key = frozenset(map(id, members))
        if key not in self._fused:
            self._fused[key] = self._fuse(members)
        return self._fused[key]

    def _fuse(self, members: list[Operator]) -> FusedOperator | None:
        members = sorted(members, key=lambda n: self.index[id(n)])
        inside = {id(t) for n in members for t in n.outputs}
        member_ids = {id(n) for n in members}
        inputs = list({id(t): t for n in members for t in n.inputs if id(t) not in inside}.values())
        used = [t for n in members for t in n.outputs
                if id(t) in self.outputs or any(id(u) not in member_ids for u in self.users.get(id(t), ()))]
        anchor = next((k for k, n in enumerate(members) if id(n) in self.anchor_nodes), None)
        fused = FusedOperator(members, inputs, used, anchor or 0)
        return fused if anchor is None or keeps_templates(members[anchor], fused, self.session) else None

    def ordered(self) -> list[list[Operator]]:
        """The groups (members in graph order), producers before consumers."""
        preds = {g: 0 for g in self.members}
        succ = {g: self.successors(g) for g in self.members}
        for g in self.members:
            for s in succ[g]:
                preds[s] += 1
        ready = deque(sorted(g for g, c in preds.items() if c == 0))
        out = []
        while ready:
            g = ready.popleft()
            out.append(sorted(self.members[g], key=lambda n: self.index[id(n)]))
            for s in sorted(succ[g]):
                preds[s] -= 1
                if preds[s] == 0:
                    ready.append(s)
        return out


class FuseOperators(GraphPass):
    """Group operators into kernels (see the module docs); each group of several operators
    becomes one FusedOperator."""

    name = "fuse_operators"
    opt_level = 1

    def transform(self, graph, ctx):
        groups = _Groups(graph, ctx.session)
        groups.fuse_epilogues()
        groups.fuse_group_epilogues()
        groups.fuse_prologues()
        groups.fuse_row_reductions()
        groups.fuse_prologues()     # producers read only by the groups the rows merged
        mapping: dict = {}

        def new(t):
            return mapping.get(id(t), t)

        for members in groups.ordered():
            fused = groups.fused(members) if len(members) > 1 else None
            if fused is None:
                for node in members:
                    mapping.update(zip(map(id, node.outputs), reapply(node, [new(t) for t in node.inputs])))
            else:
                placed = fused.with_inputs([new(t) for t in fused.inputs])
                mapping.update(zip(map(id, fused.fused_graph.outputs), placed.outputs))
        return trace_from([new(t) for t in graph.outputs], graph.inputs)

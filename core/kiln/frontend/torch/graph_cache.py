"""The whole-graph cache: compiled graphs' plans on disk, for later compiles of the same graph.

A process that compiles a graph the cache holds, for the same inputs, under the same settings
and the same code (`kiln.frontend.torch.graph_key`), skips mapping, graph passes, scheduling
and rendering: it loads the stored `kiln.runtime.plan.Plan`, whose kernels come from the kernel
cache (built again only where that lost them). An entry holds:

- the plan, whose constants are the caller's own tensors (parameters the compiled graph reads
  as they are: each hit binds the caller's, sharing memory), tensors that kernels computed
  from those while compiling (folded batch norms, merged weights: the entry holds the plan of
  those kernel runs, `kiln.runtime.folds.fold_plan`, and each hit runs it on the caller's
  parameters), or others, stored (as raw bytes beside the pickled record,
  `kiln.runtime.serialize`: CPU tensors read back as views of the entry's bytes);
- how the call's arguments reach the plan and its outputs the caller (a
  `kiln.frontend.torch.run_record.RunRecord`);
- the positions of the constants whose values the compile read (`kiln.tensor.recording_reads`:
  read by a rule or a pass, or the sources of a folded constant stored as it is), with a hash
  of those values: a hit needs the caller's to hash the same, so what was computed from them is
  the caller's own. The other constants' values are not keyed: a model with other weights finds
  the same entry.

`entry` makes an entry and `bound` binds one to a call; `kiln.save` writes entries too, for a
model captured as several graphs, which `kiln.load(path, model=...)` serves from the file.

Entries are the kind `graphs` of the kernel cache's root (`kiln.runtime.cache`): written
atomically under the entry's lock, verified when read (a damaged or foreign entry is a miss),
read back building only the runtime's own classes, and kept within KILN_GRAPH_CACHE_MB megabytes
(1024 by default) by removing the least recently used. A cache that cannot be written is
warned about once and the compile goes on.

`holds` says whether an entry is there without reading it: the backend asks it when dynamo hands
over a graph, and skips the unmapped-operator check (which loads the plugins) for one it holds.

The cache is on unless KILN_GRAPH_CACHE=0, `dynamo_config.graph_cache(False)` or torch.compile's
`options={"graph_cache": False}`. A compile that prints a correctness report or dumps its
stages (KILN_DUMP_DIR) does the whole work and is not cached (`used`); so is a graph that
cannot be keyed (`graph_key.Uncacheable`, logged). A compile's `key` is found either way, for
`kiln.save`.
"""
from __future__ import annotations

import pickle
import warnings
from dataclasses import replace

import torch

from kiln.frontend.torch.graph_key import Uncacheable, graph_key, tensor_digest
from kiln.frontend.torch.run_record import RunRecord, dumps, loads
from kiln.log import logger
from kiln.runtime import cache
from kiln.runtime.folds import FoldPlan, fold_plan, sources
from kiln.runtime.plan import Plan
from kiln.runtime.threads import each_at_once
from kiln.settings import Settings, current

KIND = "graphs"
SUFFIX = ".plan"


def key(gm, args, sizes, constant, reads, settings: Settings) -> str | None:
    """The key of this compile (see `graph_key.graph_key`), whether or not the cache is `used`
    (`kiln.save` keeps it), or None where the graph cannot be keyed (the reason logged)."""
    try:
        return graph_key(gm, args, sizes, constant, reads, settings)
    except Uncacheable as why:
        logger.info("graph not keyed (not cached, nor saved by kiln.save with graph breaks): %s", why)
        return None


def used(settings: Settings) -> bool:
    """Whether compiles under `settings` are served by the cache and stored in it."""
    return settings.graph_cache and not settings.correctness_report and not settings.dump_dir


def holds(gm, args, sizes, constant, reads, settings: Settings) -> bool:
    """Whether an entry is stored under this compile's `key` (neither read nor checked: `lookup`
    does that), asked without logging."""
    if not used(settings):
        return False
    try:
        found = graph_key(gm, args, sizes, constant, reads, settings)
    except Uncacheable:
        return False
    return cache.has_entry(KIND, found, SUFFIX)


def lookup(key: str, args) -> RunRecord | None:
    """The run stored under `key`, its constants bound to `args`, where there is one whose
    read constants have the values of `args`' (else None)."""
    data = cache.read_entry(KIND, key, SUFFIX)
    if data is None:
        logger.info("graph cache miss: %s", key)
        return None
    try:
        stored = loads(data)
    except pickle.UnpicklingError as error:     # a value the unpickler refuses, or no entry
        logger.info("graph cache miss: %s cannot be read back (%s)", key, error)
        return None
    found = bound(stored, args)
    if found is None:
        logger.info("graph cache miss: %s holds a plan for other values of constants %s", key, stored["run"].read)
    else:
        logger.info("graph cache hit: %s", key)
    return found


def folded(plan: Plan, constants: dict[int, torch.Tensor]) -> tuple[FoldPlan | None, list[int]]:
    """The plan of the kernel runs that computed some of `plan`'s constants from `constants` (by
    position among the graph's arguments) while compiling (`kiln.runtime.folds.fold_plan`), and
    the positions of the constants that its other constants were computed from (those hold
    their values: a call with other values of them needs another plan)."""
    positions = {id(t): k for k, t in constants.items()}
    computed = {slot: t for slot, t in plan.constants.items() if id(t) not in positions}
    folds = fold_plan(computed, positions)
    again = set(folds.slots) if folds else set()
    held = {positions[id(s)] for slot, t in computed.items() if slot not in again for s in sources(t)
            if id(s) in positions}
    return folds, sorted(held)


def entry(run: RunRecord, constants: dict[int, torch.Tensor]) -> dict:
    """What is kept of `run`, compiled for a call whose constants are `constants` (by position
    among the graph's arguments): "run", the run with its plan's constants that are neither among
    `constants` nor computed again by "folds" (the `folded` plan: "plan", and its "arguments"
    and the "slots" it computes); "arguments", the plan's constant slots that are among
    `constants`, with their positions; "values", the hashes of the constants whose values the
    compile read (`run.read`). The graph cache stores entries, and `kiln.save` writes them for a
    model with graph breaks."""
    positions = {id(t): k for k, t in constants.items()}
    arguments = {slot: positions[id(t)] for slot, t in run.plan.constants.items() if id(t) in positions}
    folds, _ = folded(run.plan, constants)
    again = set(folds.slots) if folds else set()
    kept = {slot: t for slot, t in run.plan.constants.items() if slot not in arguments and slot not in again}
    found = {"run": replace(run, plan=replace(run.plan, constants=kept)), "arguments": arguments,
             "values": _values_digest(constants, run.read), "folds": None}
    if folds is not None:
        found["folds"] = {"plan": folds.plan, "arguments": folds.arguments, "slots": folds.slots}
    return found


def bound(kept: dict, args, fold_kernels=None) -> RunRecord | None:
    """The run of the `entry` `kept`, its constant slots that are arguments bound to `args`'
    tensors (sharing memory) and those its fold plan computes computed from `args` (by
    `fold_kernels`, its plan's own by default), where the constants its compile read have the
    values of `args`' (else None)."""
    run = kept["run"]
    if _values_digest(args, run.read) != kept["values"]:
        return None
    arguments = {slot: args[k] for slot, k in kept["arguments"].items()}
    computed = FoldPlan(**kept["folds"]).computed(args, fold_kernels) if kept.get("folds") else {}
    return replace(run, plan=replace(run.plan, constants={**run.plan.constants, **arguments, **computed}))


def store(run: RunRecord, constants: dict[int, torch.Tensor]) -> None:
    """Keep `run` under its key as the `entry` of a call whose constants are `constants`."""
    try:
        cache.write_entry(KIND, run.key, SUFFIX, dumps(entry(run, constants)))
        cache.evict(KIND, limit())
    except cache.CacheError as error:
        warnings.warn(f"Kiln's graph cache could not store a compiled graph (the compile goes on): {error}",
                      stacklevel=3)


def limit() -> int:
    """The most bytes the entries may take: the setting `graph_cache_mb` (KILN_GRAPH_CACHE_MB)
    in megabytes."""
    return current().graph_cache_mb << 20


def _values_digest(args, positions: list[int]) -> list[str]:
    """The hashes of the constants at `positions` of `args` (a list, or a dict by position),
    several at once on torch's threads where they hold enough bytes (`kiln.runtime.threads`;
    hashing lets other threads run)."""
    return each_at_once(lambda k: tensor_digest(args[k]), positions, sum(args[k].nbytes for k in positions))

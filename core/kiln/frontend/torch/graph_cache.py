"""The whole-graph cache: compiled graphs' plans on disk, for later compiles of the same graph.

A process that compiles a graph the cache holds, for the same inputs, under the same settings
and the same code (`kiln.frontend.torch.graph_key`), skips mapping, graph passes, scheduling
and rendering: it loads the stored `kiln.runtime.plan.Plan`, whose kernels come from the kernel
cache (built again only where that lost them). An entry holds:

- the plan, whose constants are the caller's own tensors (parameters the compiled graph reads
  as they are: each hit binds the caller's, sharing memory), tensors that kernels computed
  from those while compiling (folded batch norms, merged weights: the entry holds the plan of
  those kernel runs, `kiln.runtime.folds.fold_plan`, and each hit runs it on the caller's
  parameters), or others, stored (those on the CPU as raw bytes beside the pickled record,
  `kiln.frontend.torch.packed_entry`, read back as views of the entry's bytes, copying
  nothing);
- how the call's arguments reach the plan and its outputs the caller (a
  `kiln.frontend.torch.run_record.RunRecord`);
- the positions of the constants whose values the compile read (`kiln.tensor.recording_reads`:
  read by a rule or a pass, or the sources of a folded constant stored as it is), with a hash
  of those values: a hit needs the caller's to hash the same, so what was computed from them is
  the caller's own. The other constants' values are not keyed: a model with other weights finds
  the same entry.

Entries are the kind `graphs` of the kernel cache's root (`kiln.runtime.cache`): written
atomically under the entry's lock, verified when read (a damaged or foreign entry is a miss),
read back with torch's weights-only unpickler, and kept within KILN_GRAPH_CACHE_MB megabytes
(1024 by default) by removing the least recently used. A cache that cannot be written is
warned about once and the compile goes on.

`holds` says whether an entry is there without reading it: the backend asks it when dynamo hands
over a graph, and skips the unmapped-operator check (which loads the plugins) for one it holds.

The cache is on unless KILN_GRAPH_CACHE=0, `dynamo_config.graph_cache(False)` or torch.compile's
`options={"graph_cache": False}`. A compile that prints a correctness report or dumps its
stages (KILN_DUMP_DIR) does the whole work and is not cached; so is a graph that cannot be
keyed (`graph_key.Uncacheable`, logged).
"""
from __future__ import annotations

import pickle
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from kiln.frontend.torch import packed_entry
from kiln.frontend.torch.graph_key import Uncacheable, graph_key, tensor_digest
from kiln.frontend.torch.run_record import RunRecord
from kiln.log import logger
from kiln.runtime import cache
from kiln.runtime.folds import FoldPlan, fold_plan, sources
from kiln.runtime.plan import Plan, owned
from kiln.runtime.threads import threads_for
from kiln.settings import Settings, current

KIND = "graphs"
SUFFIX = ".plan"
_FOLD = "fold "
"""The prefix of the names of a fold plan's constants among an entry's raw tensors."""


def key(gm, args, sizes, constant, reads, settings: Settings) -> str | None:
    """The cache key of this compile (see `graph_key.graph_key`), or None where the cache is
    off or cannot serve it (the reason logged)."""
    try:
        return _key(gm, args, sizes, constant, reads, settings)
    except Uncacheable as why:
        logger.info("graph cache not used: %s", why)
        return None


def holds(gm, args, sizes, constant, reads, settings: Settings) -> bool:
    """Whether an entry is stored under this compile's `key` (neither read nor checked: `lookup`
    does that), asked without logging."""
    try:
        found = _key(gm, args, sizes, constant, reads, settings)
    except Uncacheable:
        return False
    return found is not None and cache.has_entry(KIND, found, SUFFIX)


def _key(gm, args, sizes, constant, reads, settings: Settings) -> str | None:
    if not settings.graph_cache or settings.correctness_report or settings.dump_dir:
        return None
    return graph_key(gm, args, sizes, constant, reads, settings)


def lookup(key: str, args) -> RunRecord | None:
    """The run stored under `key`, its constants bound to `args`, where there is one whose
    read constants have the values of `args`' (else None)."""
    data = cache.read_entry(KIND, key, SUFFIX)
    if data is None:
        logger.info("graph cache miss: %s", key)
        return None
    try:
        entry, packed = packed_entry.loads(data)
    except (pickle.UnpicklingError, ValueError) as error:     # a value the unpickler refuses, or no entry
        logger.info("graph cache miss: %s cannot be read back (%s)", key, error)
        return None
    if _values_digest(args, entry["read"]) != entry["values"]:
        logger.info("graph cache miss: %s holds a plan for other values of constants %s", key, entry["read"])
        return None
    logger.info("graph cache hit: %s", key)
    run = entry["run"]
    bound = {slot: args[k] for slot, k in entry["arguments"].items()}
    computed = {}
    if entry.get("folds") is not None:
        folds = FoldPlan(**entry["folds"])
        held = {int(name[len(_FOLD):]): t for name, t in packed.items() if isinstance(name, str)}
        folds.plan = replace(folds.plan, constants={**folds.plan.constants, **held})
        computed = folds.computed(args)
    own = {slot: t for slot, t in packed.items() if not isinstance(slot, str)}
    run.plan = replace(run.plan, constants={**run.plan.constants, **own, **bound, **computed})
    return run


def store(key: str, run: RunRecord, args, constant_positions: list[int], read: list[int]) -> None:
    """Keep `run` under `key`: its plan's constants that are arguments at `constant_positions`
    as references to them, the others stored; `read` lists the constants whose values the
    compile read."""
    arguments = {id(args[k]): k for k in constant_positions}
    constants = run.plan.constants
    references = {slot: arguments[id(t)] for slot, t in constants.items() if id(t) in arguments}
    folds = fold_plan({slot: t for slot, t in constants.items() if slot not in references}, arguments)
    recomputed = set(folds.slots) if folds else set()
    stored = {slot: t for slot, t in constants.items() if slot not in references and slot not in recomputed}
    # a folded constant stored as it is holds the values of the arguments it was computed from
    read = sorted({*read, *(arguments[id(s)] for t in stored.values() for s in sources(t) if id(s) in arguments)})
    run_plan, packed = _packed(replace(run.plan, constants=stored), "")
    entry = {"run": replace(run, plan=run_plan), "arguments": references, "read": read,
             "values": _values_digest(args, read), "folds": None}
    if folds is not None:
        folds_plan, held = _packed(folds.plan, _FOLD)
        entry["folds"] = {"plan": folds_plan, "arguments": folds.arguments, "slots": folds.slots}
        packed.update(held)
    try:
        cache.write_entry(KIND, key, SUFFIX, packed_entry.dumps(entry, packed))
        cache.evict(KIND, limit())
    except cache.CacheError as error:
        warnings.warn(f"Kiln's graph cache could not store a compiled graph (the compile goes on): {error}",
                      stacklevel=3)


def _packed(plan: Plan, prefix: str) -> tuple[Plan, dict]:
    """`plan` holding only its constants that are not written as raw bytes, and those, by their
    slot (with `prefix`, a string, where it is not empty)."""
    stored = {slot: owned(t) for slot, t in plan.constants.items()}
    packed = {f"{prefix}{slot}" if prefix else slot: t for slot, t in stored.items() if packed_entry.packable(t)}
    pickled = {slot: t for slot, t in stored.items() if not packed_entry.packable(t)}
    return replace(plan, constants=pickled), packed


def limit() -> int:
    """The most bytes the entries may take: the setting `graph_cache_mb` (KILN_GRAPH_CACHE_MB)
    in megabytes."""
    return current().graph_cache_mb << 20


def _values_digest(args, positions: list[int]) -> list[str]:
    """The hashes of the constants at `positions`, several at once on torch's threads where
    they hold enough bytes (`kiln.runtime.threads`; hashing lets other threads run)."""
    workers = threads_for(len(positions), sum(args[k].nbytes for k in positions))
    if workers <= 1:
        return [tensor_digest(args[k]) for k in positions]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda k: tensor_digest(args[k]), positions))

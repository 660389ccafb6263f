"""Show or clear Kiln's on-disk caches ($KILN_CACHE_DIR, else ~/.cache/kiln): the kernel cache
(built kernels, by device kind) and the whole-graph cache (compiled graphs' plans, the kind
`graphs`)."""
from __future__ import annotations

from kiln.table import format_table

HELP = "show (status) or empty (clear) the on-disk kernel and graph caches"


def configure(parser) -> None:
    parser.add_argument("action", nargs="?", choices=("status", "clear"), default="status",
                        help="status (default): entries and sizes by kind; clear: delete every entry")
    parser.add_argument("--kind", help="clear only the entries of this kind (cpu, cuda, graphs)")


def human_size(n: int) -> str:
    """`n` bytes as a short human-readable size."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def format_status(status: dict, graph_cache: str) -> str:
    """The report of `kiln cache status` for `kiln.runtime.cache.status()`, ending with the
    line `graph_cache` about the whole-graph cache's setting."""
    kinds = status["kinds"]
    rows = [(kind, str(v["entries"]), human_size(v["bytes"])) for kind, v in kinds.items()]
    rows.append(("total", str(sum(v["entries"] for v in kinds.values())),
                 human_size(sum(v["bytes"] for v in kinds.values()))))
    table = format_table(rows, ("kind", "entries", "size"), rule=False, indent="  ")
    return f"kernel cache: {status['path']}\n{table}\n{graph_cache}"


def run(args) -> int:
    from kiln.frontend.torch import dynamo_config, graph_cache
    from kiln.runtime import cache

    if args.action == "clear":
        cleared = cache.clear(args.kind)
        what = f" of kind {args.kind}" if args.kind else ""
        print(f"removed {cleared.removed} entries{what} from {cache.cache_dir()}")
        if cleared.failed:
            print(f"could not remove {len(cleared.failed)} paths:")
            for path in cleared.failed:
                print(f"  {path}")
            return 1
    else:
        setting = "on" if dynamo_config.resolve().graph_cache else "off (KILN_GRAPH_CACHE=0)"
        print(format_status(cache.status(), f"graph cache (kind {graph_cache.KIND}): {setting}, "
                                            f"at most {human_size(graph_cache.limit())} (KILN_GRAPH_CACHE_MB)"))
    return 0

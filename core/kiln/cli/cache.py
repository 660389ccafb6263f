"""Show or clear Kiln's on-disk kernel cache ($KILN_CACHE_DIR, else ~/.cache/kiln)."""
from __future__ import annotations

from kiln.table import format_table

HELP = "show (status) or empty (clear) the on-disk kernel cache"


def configure(parser) -> None:
    parser.add_argument("action", nargs="?", choices=("status", "clear"), default="status",
                        help="status (default): entries and sizes by kind; clear: delete every entry")


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


def format_status(status: dict) -> str:
    """The report of `kiln cache status` for `kiln.runtime.cache.status()`."""
    kinds = status["kinds"]
    rows = [(kind, str(v["entries"]), human_size(v["bytes"])) for kind, v in kinds.items()]
    rows.append(("total", str(sum(v["entries"] for v in kinds.values())),
                 human_size(sum(v["bytes"] for v in kinds.values()))))
    table = format_table(rows, ("kind", "entries", "size"), rule=False, indent="  ")
    return f"kernel cache: {status['path']}\n{table}"


def run(args) -> int:
    from kiln.runtime import cache

    if args.action == "clear":
        cleared = cache.clear()
        print(f"removed {cleared.removed} entries from {cache.cache_dir()}")
        if cleared.failed:
            print(f"could not remove {len(cleared.failed)} paths:")
            for path in cleared.failed:
                print(f"  {path}")
            return 1
    else:
        print(format_status(cache.status()))
    return 0

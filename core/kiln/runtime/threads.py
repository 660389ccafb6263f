"""How many threads to spread work over several items on: where it is worth starting them."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

AT_ONCE = 1 << 22
"""Work over fewer bytes than this is done in the calling thread: sooner than threads start."""


def threads_for(items: int, nbytes: int) -> int:
    """The threads for work over `items` items holding `nbytes` bytes: torch's number of threads,
    at most one an item; 1 where they hold no more than AT_ONCE bytes."""
    return 1 if nbytes <= AT_ONCE else min(torch.get_num_threads(), items)


def each_at_once(fn: Callable, items: Sequence, nbytes: int) -> list:
    """`[fn(item) for item in items]`, several at once on `threads_for(len(items), nbytes)`
    threads where that is more than one, else in the calling thread."""
    workers = threads_for(len(items), nbytes)
    if workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))

"""How many threads to spread work over several items on: where it is worth starting them."""
from __future__ import annotations

import torch

AT_ONCE = 1 << 22
"""Work over fewer bytes than this is done in the calling thread: sooner than threads start."""


def threads_for(items: int, nbytes: int) -> int:
    """The threads for work over `items` items holding `nbytes` bytes: torch's number of threads,
    at most one an item; 1 where they hold no more than AT_ONCE bytes."""
    return 1 if nbytes <= AT_ONCE else min(torch.get_num_threads(), items)

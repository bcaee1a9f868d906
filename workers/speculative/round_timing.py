"""Start-up timing of decode steps by draft length: the cost model's priors (`cost_model.py`).

With CUDA graphs captured, what a steady greedy step replays is known, so it is timed before
serving rather than learned by running badly: for every captured batch size and k in
0..num_steps, the replays of a plain decode step (k = 0) or of a round of k drafts, each staged
as a step stages it, on rows of padding (short KV: attention at longer contexts, and the host's
bookkeeping, are what serving's own measurements add). A round of a draft with KV of its own is
its chained draft steps 2..k, the verify and the catch-up; a frozen-KV draft's is the verify and
its steps 1..k chained (standing in for the catch-up), or step 1 alone for k = 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from attention import ForwardMode
from workers.model_runner import ModelRunner
from workers.speculative.drafter import Drafter

WARMUP, REPEATS = 2, 8


def time_rounds(target: ModelRunner, drafter: Drafter, num_steps: int) -> dict[tuple[int, int], float]:
    """(batch size, k) -> seconds of a step, for every batch size the target's graphs captured."""
    return {
        (size, k): _seconds(_replays(target, drafter, k, size))
        for size in target.graphs.batch_sizes
        for k in range(num_steps + 1)
    }


def _replays(target: ModelRunner, drafter: Drafter, k: int, size: int) -> list[Callable[[], None]]:
    """The replays of one steady greedy step of `k` drafts for `size` requests, in launch order."""
    tg, dg, pool = target.graphs, drafter.runner.graphs, target.pool
    if k == 0:
        return [tg.replayer(ForwardMode.DECODE, 1, pool, batch_size=size)]
    verify = tg.replayer(ForwardMode.TARGET_VERIFY, k + 1, pool, batch_size=size)
    if drafter.runner.pool is None:  # frozen KV: steps 1..k chained (step 1 alone) after the verify
        return [verify, dg.replayer(ForwardMode.DECODE, 1, pool, drafter.query_offset(1), k if k > 1 else 0, size)]
    own = drafter.runner.pool
    chain = [dg.replayer(ForwardMode.DECODE, 1, own, chain=k - 1, batch_size=size)] if k > 1 else []
    return [*chain, verify, dg.replayer(ForwardMode.DRAFT_EXTEND_V2, k + 1, own, batch_size=size)]


def _seconds(replays: list[Callable[[], None]]) -> float:
    """Wall seconds per run of `replays` in a row (the host's staging and the device's replays
    overlap as in serving), after a warm-up."""
    for _ in range(WARMUP):
        for replay in replays:
            replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPEATS):
        for replay in replays:
            replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPEATS

"""Split reductions finished inside the kernel that split them: the last program to arrive
combines the partial results.

A kernel that splits a reduction over programs (split-K projections, split-KV attention) would
otherwise need a second kernel to combine the partials, and in a batch-1 decode step a kernel
boundary costs about as much as the combine itself. Here each group of programs shares a counter:
every program stores its partial, then takes a ticket; the one holding the last ticket reads all
the partials (the ticket's acquire makes them visible) and sets the counter back to zero, so the
next launch finds it as this one did.

The counters live in one zeroed buffer per device, allocated on first use and never moved (a
captured graph holds its address). Kernels using them run one at a time on the device: a
decode step's kernels are one stream, and each waits for the kernel before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CAPACITY = 1 << 16  # counters: groups of one launch (rows x KV heads, output tiles)

_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, groups: int) -> torch.Tensor:
    """The device's counter buffer (all zero between launches); `groups` is what the launch uses."""
    if groups > CAPACITY:
        raise ValueError(f"a split reduction over {groups} groups exceeds the {CAPACITY} counters")
    buf = _counters.get(device)
    if buf is None:
        buf = _counters[device] = torch.zeros(CAPACITY, dtype=torch.int32, device=device)
    return buf


@triton.jit
def last_arrival(counter_ptr, arrivals):
    """Called by every program of a group after storing its partial: True in the program that
    arrives last, which may then read the group's partials; it resets the counter itself."""
    tl.debug_barrier()  # every thread's partial is stored before the program takes its ticket
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == arrivals - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last

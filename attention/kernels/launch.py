"""Programmatic dependent launch (PDL) for this project's Triton kernels, Hopper and later.

Inside a decode step's CUDA graph each small kernel waits for the one before it to drain and
then pays its own launch and ramp-up: about a microsecond a boundary, hundreds of boundaries a
step. Launched with PDL, a kernel's launch overlaps the end of the kernel before it, and its
programs wait (`gdc_wait`) before reading what that kernel wrote.
Every kernel launched this way calls `gdc_wait` before its first read of a predecessor's
output, so a chain of them stays ordered. flashinfer's kernels and XQA launch this way too.

`SLIDESPEC_PDL=0` turns it off; without Triton's grid-dependency control it is off.

A kernel launched early may also read, before its wait, what no kernel writes: the one-row
GEMV loads a small row block's whole weights there (`gemv.py`), so they arrive while the kernel
before still runs. `SLIDESPEC_PRELOAD=0` keeps every load after the wait.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _SUPPORTED = hasattr(CUDAOptions, "launch_pdl")
except ImportError:  # a Triton without grid-dependency control: PDL stays off
    _SUPPORTED = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


# A kernel of at most this many programs lets its successor launch as soon as each of its programs
# has waited (they all run at once: the successor's programs take free slots and wait there); a
# larger grid lets it launch at completion, since waiting programs would hold the slots its
# later waves need (an early trigger on every kernel made Gemma-3-1B 1.24 -> 1.49 ms a batch-1
# step on an H200). With 1000 against 0, same machine: Gemma-3-1B batch 64 1.93 -> 1.78 ms,
# batch 1 about 3% faster, Llama-3-8B batch 1 1.0%, Gemma-3-12B batch 1 1.8%.
EARLY_PROGRAMS = int(os.environ.get("SLIDESPEC_PDL_EARLY", "1000"))


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A PDL-launched kernel's first read of a predecessor's output comes after this: wait for
    the kernel before (its writes become visible), then (`PDL` 2) let the next one launch."""
    if PDL:
        gdc_wait()
        if PDL == 2:
            gdc_launch_dependents()


@functools.cache
def pdl_enabled() -> bool:
    return (
        _SUPPORTED
        and os.environ.get("SLIDESPEC_PDL", "1") != "0"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] >= 9
    )


PRELOAD = os.environ.get("SLIDESPEC_PRELOAD", "1") != "0"


def preloads() -> bool:
    """Whether kernels read their weights before the wait (without PDL nothing overlaps)."""
    return PRELOAD and pdl_enabled()


def pdl_options(programs: int) -> dict:
    """Launch keywords for a kernel of `programs` programs taking a `PDL` constexpr that it
    passes to `pdl_start` (0: off; 1: successor launched at completion; 2: early)."""
    if not pdl_enabled():
        return {"PDL": 0}
    return {"PDL": 2 if programs <= EARLY_PROGRAMS else 1, "launch_pdl": True}

"""Tensor-parallel groups for tests, without Ray: `world` processes (gloo on a CPU, NCCL on GPUs)
run `RankLoop` in lockstep over PROMPTS, in two waves (the second reuses the first's prefixes)
and a cache flush. A group's processes start once and serve engine runs one after another
(`RankGroup.run_each`): starting one costs seconds of imports a process, so the CPU tests share
one group of two ranks (`tp2`). This module imports only what a rank needs."""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.hf_models import random_prompts
from workers.distributed import TPGroup
from workers.engine import Engine, SamplingParams
from workers.rank_loop import RankLoop

GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
FIRST = random_prompts([29, 11, 17])
PROMPTS = FIRST + [FIRST[0][:21] + [7, 8, 9], FIRST[1]]  # the second wave hits the first's pages
RESULT_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cuda: bool, jobs, results) -> None:
    """A rank's process: joins the group, then serves each job (engine runs and their sampling)
    until it gets None."""
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    control = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    while (job := jobs.get()) is not None:
        runs, sampling = job
        for engine_kwargs in runs:
            _serve(rank, world, control, engine_kwargs, sampling, results)
    dist.barrier(group=control)  # no rank closes its connections while another still reads from them
    dist.destroy_process_group()
    # Leave without running C++ static destructors: at interpreter exit gloo's threads were now
    # and then destroyed while joinable ("terminate called without an active exception").
    results.close()
    results.join_thread()
    os._exit(0)


def _serve(rank: int, world: int, control, engine_kwargs: dict, sampling: SamplingParams, results) -> None:
    """PROMPTS in two waves through one engine of the group, then a cache flush; rank 0 puts the
    outputs on `results`."""
    engine = Engine(**engine_kwargs, tp=TPGroup(rank, world, dist.group.WORLD))
    outputs = {}

    def on_updates(updates):
        for update in updates:
            if update.finished:
                outputs[update.rid] = update.output
                if len(outputs) == len(FIRST):
                    for i in range(len(FIRST), len(PROMPTS)):
                        loop.submit(f"r{i}", PROMPTS[i], sampling)
                if len(outputs) == len(PROMPTS):
                    loop.flush_cache()
                    loop.stop()

    loop = RankLoop(engine, rank, control, on_updates)
    if rank == 0:
        for i, prompt in enumerate(FIRST):
            loop.submit(f"r{i}", prompt, sampling)
    loop.run()
    engine.check_no_leak()
    engine.allocator.check_no_leak()  # the flush reached this rank: its pools are full
    if rank == 0:
        # Plain pickle: torch's queue would share tensors through this process, which may exit.
        results.put(pickle.dumps([outputs[f"r{i}"] for i in range(len(PROMPTS))]))


class RankGroup:
    """`world` rank processes, started once; a run that fails stops them (the next run starts
    new ones)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.cuda = False
        self._procs: list = []

    def _start(self, cuda: bool) -> None:
        self.cuda = cuda
        ctx = mp.get_context("spawn")
        self._jobs = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(target=_rank_main, args=(r, self.world, port, self.cuda, self._jobs[r], self._results))
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def run_each(self, runs: list[dict], sampling: SamplingParams = GREEDY) -> list:
        """The outputs of PROMPTS for each of `runs` (engine arguments), one after another (on GPUs,
        NCCL, when the first run's device is cuda)."""
        cuda = runs[0].get("device") == "cuda"
        if not self._procs:
            self._start(cuda)
        assert cuda == self.cuda, "a group serves runs on one kind of device"
        for jobs in self._jobs:
            jobs.put((runs, sampling))
        try:
            return [pickle.loads(self._result()) for _ in runs]
        except BaseException:
            self._kill()
            raise

    def _result(self) -> bytes:
        """Rank 0's next result; fails at once when a rank has died."""
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while True:
            try:
                return self._results.get(timeout=1)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
                assert not dead, f"ranks {dead} exited (codes {[self._procs[r].exitcode for r in dead]})"
                assert time.monotonic() < deadline, f"no result within {RESULT_TIMEOUT_S} s"

    def close(self) -> None:
        """Stop the ranks; they must exit cleanly."""
        if not self._procs:
            return
        for jobs in self._jobs:
            jobs.put(None)
        for p in self._procs:
            p.join(timeout=60)
        codes = [p.exitcode for p in self._procs]
        self._kill()
        assert codes == [0] * self.world, f"rank exit codes {codes}"

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join()
        self._procs = []


def run_tp(world: int, engine_kwargs: dict, sampling: SamplingParams = GREEDY):
    """Outputs of PROMPTS from a new group of `world` ranks."""
    return run_tp_each(world, [engine_kwargs], sampling)[0]


def run_tp_each(world: int, runs: list[dict], sampling: SamplingParams = GREEDY) -> list:
    """`RankGroup.run_each` in a new group of `world` ranks, stopped after."""
    group = RankGroup(world)
    try:
        return group.run_each(runs, sampling)
    finally:
        group.close()

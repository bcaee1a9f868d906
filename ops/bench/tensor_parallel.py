"""Decode throughput of one replica at tensor-parallel sizes 1, 2, ... on the GPUs of one host.

    python -m ops.bench.tensor_parallel --out results.json [--tp-sizes 1,2] [--batches 1,64] \
        [--all-reduce nccl,one_shot,one_shot_unfused]
    python -m ops.bench.tensor_parallel --out moe.json --shape gpt-oss-20b --all-reduce nccl \
        --moe-parallel tensor,expert
    python -m ops.bench.tensor_parallel --out spec.json --batches 1 --all-reduce one_shot \
        --speculative eagle3,eagle3-replicated

Each size runs in its own processes, one a GPU, exactly as a serving replica's rank actors do:
NCCL for the model's collectives, gloo for the step plans, `RankLoop` in lockstep, CUDA graphs on
(the collectives are captured in them). Rank 0 submits a batch of greedy requests (the Llama-3-8B
shape with dummy weights by default, prompt 128, 128 new tokens) and times the decode phase: from
the moment every request has its first token to the last token. The same harness at size 1 is
the baseline, so a size's speed-up is one division. Sizes above 1 run with each all-reduce asked
for: `nccl` and `one_shot` are the `tp_all_reduce` settings (one-shot over peer memory, the
all-reduce before each norm fused with the residual add and the norm), `one_shot_unfused` is
`one_shot` with those apart (the one-shot kernel, then the add + norm kernel: what the fusion
saves is the difference); and, for the mixture-of-experts shapes (gemma4-26b-a4b, gpt-oss-20b),
each `moe_parallel` asked for (experts split by tensor or by expert; runs of the latter are named
`.../moe_expert`); and each `--speculative` draft of the shape (`decode_throughput`'s dummy drafts,
4 steps a round, fixed rounds; runs named `.../spec_<draft>`), whose rounds are timed against the
plain steps of the same size and all-reduce (`round_over_plain_step`: dummy drafts are almost
never accepted, so a step is a round). Also measured: captured graphs of 64 all-reduces of one decode step's hidden
state (bf16, batch 1 and 64), the collective's own cost per step, alone (`allreduce_us`) and
with the residual add and RMSNorm after it (`allreduce_norm_us`, `TPGroup.all_reduce_add_rms_norm`).
With `--profile N`, rank 0 runs each batch once more under torch.profiler from the moment every
request has its first token (`ops/bench/profile_step.py`'s summary: GPU-busy ms, kernel launches
and host synchronisations per step, the N kernels that add the most time and the longest idle
gaps), written to `--out` beside the timed figures and not recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import pickle
import queue
import tempfile
import threading
import time

import torch
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from ops.bench import free_port
from ops.bench.decode_throughput import NEW, PROMPT, SHAPES, SPEC_TARGETS, random_prompts, write_config
from ops.bench.profile_step import kernel_summary
from ops.bench.record import add_record_args, record_run
from workers.distributed import TPGroup, join_tp_group, leave_tp_group
from workers.engine import Engine, SamplingParams
from workers.models import load_model_config
from workers.rank_loop import RankLoop, Update

logger = logging.getLogger(__name__)


class BatchClock:
    """Rank 0's view of one batch: when every request had its first token, when the last ended."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.first: dict[str, float] = {}
        self.tokens = 0
        self.finished = 0
        self.started = threading.Event()  # every request has its first token
        self.done = threading.Event()

    def on_updates(self, updates: list[Update]) -> None:
        now = time.perf_counter()
        for u in updates:
            if u.token_ids and u.rid not in self.first:
                self.first[u.rid] = now
                if len(self.first) == self.size:
                    self.started.set()
            elif u.rid in self.first:
                self.tokens += len(u.token_ids)
            if u.error:
                raise RuntimeError(f"request {u.rid} failed: {u.error}")
            if u.finished:
                self.finished += 1
                if self.finished == self.size:
                    self.end = now
                    self.done.set()

    def result(self) -> dict:
        seconds = self.end - max(self.first.values())
        steps = self.tokens / self.size
        return {
            "tokens": self.tokens,
            "seconds": seconds,
            "tok_per_s": self.tokens / seconds,
            "ms_per_step": 1e3 * seconds / steps,
        }


# --all-reduce names -> (tp_all_reduce setting, the all-reduce before a norm fused with it)
ALL_REDUCES = {"nccl": ("nccl", True), "one_shot": ("one_shot", True), "one_shot_unfused": ("one_shot", False)}


def allreduce_graph_us(tp: TPGroup, hidden: int, batch: int, norm: bool = False, count: int = 64) -> float:
    """Microseconds per all-reduce (`norm`: all-reduce, residual add and RMSNorm) in a captured
    graph of `count` (one decode step's worth)."""
    x = torch.ones(batch, hidden, dtype=torch.bfloat16, device="cuda")
    residual, weight = torch.zeros_like(x), torch.ones(hidden, dtype=torch.bfloat16, device="cuda")

    def collective() -> None:
        if norm:
            tp.all_reduce_add_rms_norm(x, residual, weight, 1e-6, False)
        else:
            tp.all_reduce(x)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            collective()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(count):
            collective()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / reps / count


def _rank_main(
    rank: int,
    world: int,
    port: int,
    engine_kwargs: dict,
    batches: list[int],
    all_reduce: str,
    results,
    profile_top: int = 0,
) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank}/{world} %(message)s")
    torch.cuda.set_device(rank)
    setting, fuse_norm = ALL_REDUCES[all_reduce]
    init = f"tcp://127.0.0.1:{port}"
    tp, control = join_tp_group(rank, world, init, "cuda", datetime.timedelta(seconds=300), fuse_norm)
    engine = Engine(**engine_kwargs, tp=tp, tp_all_reduce=setting)
    out: dict = {}
    if world > 1:
        for batch in (1, 64):
            out[f"allreduce_us/b{batch}"] = allreduce_graph_us(tp, engine.cfg.hidden_size, batch)
            out[f"allreduce_norm_us/b{batch}"] = allreduce_graph_us(tp, engine.cfg.hidden_size, batch, norm=True)
    clock = BatchClock(0)
    loop = RankLoop(engine, rank, control, lambda updates: clock.on_updates(updates))
    if rank != 0:
        loop.run()
    else:
        thread = threading.Thread(target=loop.run, name="rank0-loop")
        thread.start()
        for tag, batch in [("warmup", max(batches))] + [(f"b{b}", b) for b in batches]:
            clock = BatchClock(batch)
            _submit(loop, engine.cfg.vocab_size, batch, tag)
            if not clock.done.wait(600):
                raise TimeoutError(f"tp {world} batch {batch} did not finish")
            if tag != "warmup":
                out[tag] = clock.result()
                logger.info("tp %d batch %d: %.1f tok/s", world, batch, out[tag]["tok_per_s"])
                if profile_top:
                    clock = BatchClock(batch)
                    out[tag]["profile"] = _profiled(loop, clock, engine.cfg.vocab_size, f"{tag}-profiled", profile_top)
        loop.stop()
        thread.join()
        results.put(pickle.dumps(out))
        results.close()
        results.join_thread()  # the result is in the pipe before os._exit, which skips the queue's flush
    engine.check_no_leak()
    leave_tp_group(control, "cuda")
    os._exit(0)  # without tearing NCCL down (`leave_tp_group`)


def _submit(loop: RankLoop, vocab: int, batch: int, tag: str) -> None:
    """A batch of greedy requests (the same prompts for the same batch size), ids `tag-i`."""
    sampling = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(vocab, batch, PROMPT, seed=batch)):
        loop.submit(f"{tag}-{i}", prompt, sampling)


def _profiled(loop: RankLoop, clock: BatchClock, vocab: int, tag: str, top: int) -> dict:
    """The batch of `clock` once more, its decode profiled from the moment every request has its
    first token to the last token (`kernel_summary`; the steps counted in that time)."""
    _submit(loop, vocab, clock.size, tag)
    if not clock.started.wait(600):
        raise TimeoutError(f"{tag}: the batch did not start")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tokens = clock.tokens
        if not clock.done.wait(600):
            raise TimeoutError(f"{tag}: the batch did not finish")
        steps = max(1, round((clock.tokens - tokens) / clock.size))
    return kernel_summary(prof, steps, top)


def run_size(world: int, engine_kwargs: dict, batches: list[int], all_reduce: str, profile_top: int = 0) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, engine_kwargs, batches, all_reduce, results, profile_top))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 1800
    while True:
        try:
            out = pickle.loads(results.get(timeout=5))
            break
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            silent = all(p.exitcode == 0 for p in procs)  # every rank gone without a result
            if failed or silent or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                why = f"a rank exited with {failed[0]}" if failed else "no result" if silent else "timed out"
                raise RuntimeError(f"tp {world}: {why}") from None
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise RuntimeError(f"tp {world}: a rank exited with {p.exitcode}")
    return out


def run_name(world: int, all_reduce: str, moe_parallel: str, draft: str | None = None) -> str:
    """A run's key in the report: experts split by tensor (the default) and plain decoding go
    unnamed."""
    return (
        f"tp{world}/{all_reduce}"
        + ("" if moe_parallel == "tensor" else f"/moe_{moe_parallel}")
        + ("" if draft is None else f"/spec_{draft}")
    )


REPLICATED = "-replicated"  # a draft name's suffix: the draft whole on every rank (`draft_tp: replicate`)


def spec_settings(root: str, shape: str, names: str) -> dict[str, dict]:
    """The speculative settings of `names` (comma-separated) among `shape`'s dummy drafts, each
    sharded like the target unless named with `REPLICATED`."""
    wanted = [n for n in names.split(",") if n]
    if not wanted:
        return {}
    if shape not in SPEC_TARGETS:
        raise SystemExit(f"--speculative: {shape} has no drafts; shapes with drafts: {', '.join(SPEC_TARGETS)}")
    specs = SPEC_TARGETS[shape][1](root)
    unknown = sorted({n.removesuffix(REPLICATED) for n in wanted} - set(specs))
    if unknown:
        raise SystemExit(f"--speculative: {', '.join(unknown)} unknown for {shape}; choose from {', '.join(specs)}")
    out = {}
    for name in wanted:
        base = name.removesuffix(REPLICATED)
        out[name] = {**specs[base], "draft_tp": "replicate" if name != base else "shard"}
    return out


def cases(report: dict) -> dict[str, dict]:
    """One case a shape, size, all-reduce and batch: its decode rate, the speed-up over one GPU
    and what one all-reduce of the hidden state (alone, and with the add and norm after it) costs
    in a graph at that batch. A run that timed drafts keeps its plain steps inside the drafts'
    cases (`plain_ms_per_step`) unless one GPU was measured too, so that a record of rounds never
    replaces a plain case that had its speed-up."""
    timed_drafts = any("/spec_" in run for run in report)
    out = {}
    for run, got in report.items():
        if run.startswith("tp"):
            for batch, figures in got.items():
                if not isinstance(figures, dict):
                    continue
                if timed_drafts and "/spec_" not in run and "speedup_over_tp1" not in figures:
                    continue
                keys = (f"{k}/{batch}" for k in ("allreduce_us", "allreduce_norm_us"))
                reduce = {key.split("/")[0]: got[key] for key in keys if key in got}
                timed = {k: v for k, v in figures.items() if k != "profile"}  # (a profile stays in --out)
                out[f"{report['shape']}/{run}/{batch}"] = {**timed, **reduce}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--tp-sizes", default="1,2")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument(
        "--all-reduce",
        default="nccl,one_shot,one_shot_unfused",
        help=f"all-reduces to run at sizes > 1, of {', '.join(ALL_REDUCES)}",
    )
    parser.add_argument(
        "--moe-parallel", default="tensor", help="moe_parallel settings to run at sizes > 1 (tensor,expert: both)"
    )
    parser.add_argument(
        "--speculative",
        default="",
        help="drafts to time rounds of besides plain steps (decode_throughput's: eagle, eagle3, frozen_kv_mtp "
        f"for llama3-8b, assistant for gemma4-31b), comma-separated; a name ending {REPLICATED} runs the draft "
        "whole on every rank",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="rank 0 profiles each batch once more: the N costliest kernels a step, in --out only",
    )
    add_record_args(parser)
    args = parser.parse_args(argv)
    if args.profile < 0:
        raise SystemExit(f"--profile: {args.profile} kernels; give 0 (no profile) or more")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    batches = [int(b) for b in args.batches.split(",")]
    sizes = [int(s) for s in args.tp_sizes.split(",")]
    unknown = set(args.all_reduce.split(",")) - set(ALL_REDUCES)
    if unknown:
        raise SystemExit(f"--all-reduce: {', '.join(sorted(unknown))} unknown; choose from {', '.join(ALL_REDUCES)}")
    if max(sizes) > torch.cuda.device_count():
        raise SystemExit(f"--tp-sizes {args.tp_sizes}: this host has {torch.cuda.device_count()} GPUs")
    with tempfile.TemporaryDirectory() as root:
        engine_kwargs = dict(
            model=write_config(root, args.shape, SHAPES[args.shape]),
            device="cuda",
            dtype="bfloat16",
            load_format="dummy",
            page_size=16,
            swa_full_tokens_ratio=1.0,
            max_total_tokens=max(batches) * (PROMPT + NEW + 64),
            max_running_requests=max(batches),
            chunked_prefill_size=8192,
        )
        report: dict = {"shape": args.shape, "prompt": PROMPT, "new_tokens": NEW, "gpu": torch.cuda.get_device_name()}
        moe_modes = args.moe_parallel.split(",")
        if moe_modes != ["tensor"] and load_model_config(engine_kwargs["model"]).moe is None:
            raise SystemExit(f"--moe-parallel {args.moe_parallel}: {args.shape} has no mixture of experts")
        drafts = spec_settings(root, args.shape, args.speculative)
        runs = [(w, "nccl", "tensor", d) for w in sizes if w == 1 for d in [None, *drafts]] + [
            (w, ar, moe, d)
            for w in sizes
            if w > 1
            for ar in args.all_reduce.split(",")
            for moe in moe_modes
            for d in [None, *drafts]
        ]
        for world, all_reduce, moe, draft in runs:
            kwargs = {**engine_kwargs, "moe_parallel": moe}
            if draft is not None:
                kwargs["speculative"] = drafts[draft]
            name = run_name(world, all_reduce, moe, draft)
            try:
                report[name] = run_size(world, kwargs, batches, all_reduce, args.profile)
            except RuntimeError:  # the other runs still measure; the report names the failed one
                logger.exception("%s failed", name)
                report.setdefault("failed", []).append(name)
    base = report.get("tp1/nccl", {})
    for world, all_reduce, moe, draft in runs:
        name, plain = run_name(world, all_reduce, moe, draft), report.get(run_name(world, all_reduce, moe))
        if name not in report or plain is None:
            continue
        for b in batches:
            got = report[name][f"b{b}"]
            if draft is None and f"b{b}" in base:
                got["speedup_over_tp1"] = got["tok_per_s"] / base[f"b{b}"]["tok_per_s"]
            if draft is not None:
                got["plain_ms_per_step"] = plain[f"b{b}"]["ms_per_step"]
                got["round_over_plain_step"] = got["ms_per_step"] / got["plain_ms_per_step"]
            print(
                f"tp {world} ({all_reduce}, experts by {moe}{', draft ' + draft if draft else ''}) batch {b}: "
                f"{got['tok_per_s']:.1f} tok/s, {got['ms_per_step']:.2f} ms/step"
                + (f", {got['speedup_over_tp1']:.2f}x tp1" if "speedup_over_tp1" in got else "")
                + (f", {got['round_over_plain_step']:.2f}x a plain step" if "round_over_plain_step" in got else "")
            )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    metrics = [
        "tok_per_s",
        "ms_per_step",
        "speedup_over_tp1",
        "round_over_plain_step",
        "plain_ms_per_step",
        "allreduce_us",
        "allreduce_norm_us",
    ]
    record_run(args, "tensor_parallel", cases(report), metrics)
    return report


if __name__ == "__main__":
    main()

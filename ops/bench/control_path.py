"""Per-step overhead of the control path on CPU: decode steps per second of one request on a
tiny model, run five ways:

  engine      `Engine.step()` in a loop, in process
  spec_plain  the same with a speculative engine held at plain steps (a standalone self-draft over
              the SWA pool, k = 0 every step): what a draft costs the steps where drafting does not pay
  rank_loop   one `RankLoop` in a thread, requests queued from another (no collectives)
  tp2_gloo    two processes (torch.distributed, gloo) in lockstep: plan broadcast + all-reduces
  tp2_ray     a Serve replica of two Ray rank actors, tokens streamed back through Serve

    python -m ops.bench.control_path --steps 200 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import socket
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from ops.bench import emit
from ops.bench.record import add_record_args, record_run
from workers.distributed import TPGroup
from workers.engine import Engine, SamplingParams
from workers.rank_loop import RankLoop
from workers.speculative.controller import FixedDraftSteps


def tiny_model_dir() -> str:
    """A Gemma 3-style hybrid config small enough that the control path dominates a step."""
    path = tempfile.mkdtemp(prefix="control_path_")
    cfg = transformers.Gemma3TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    cfg.save_pretrained(path)
    return path


def engine_kwargs(model: str) -> dict:
    return dict(model=model, load_format="dummy", page_size=16, max_total_tokens=8192, chunked_prefill_size=256)


def sampling(steps: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=steps + 1, temperature=0.0, ignore_eos=True)


def bench_engine(model: str, steps: int, speculative: dict | None = None) -> float:
    eng = Engine(**engine_kwargs(model), speculative=speculative)
    if speculative is not None:
        eng.spec.controller = FixedDraftSteps(0)
    eng.add_request([1, 2, 3, 4], sampling(steps))
    eng.step()  # prefill
    start = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return steps / (time.perf_counter() - start)


def bench_spec_plain(model: str, steps: int) -> float:
    spec = {"algorithm": "standalone", "draft_model": model, "draft_load_format": "dummy", "num_steps": 2}
    return bench_engine(model, steps, spec)


def _timed_stream(loop: RankLoop, steps: int) -> float:
    times = []
    done = threading.Event()

    def on_updates(updates):
        times.append(time.perf_counter())
        if updates[-1].finished:
            done.set()

    loop.on_updates = on_updates
    loop.submit("r", [1, 2, 3, 4], sampling(steps))
    done.wait()
    return (len(times) - 1) / (times[-1] - times[0])


def bench_rank_loop(model: str, steps: int) -> float:
    loop = RankLoop(Engine(**engine_kwargs(model)), rank=0)
    thread = threading.Thread(target=loop.run)
    thread.start()
    rate = _timed_stream(loop, steps)
    loop.stop()
    thread.join()
    return rate


def _tp_rank(rank: int, port: int, model: str, steps: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    loop = RankLoop(Engine(**engine_kwargs(model), tp=TPGroup(rank, 2, dist.group.WORLD)), rank, dist.group.WORLD)
    if rank == 0:
        thread = threading.Thread(target=loop.run)
        thread.start()
        results.put(_timed_stream(loop, steps))
        loop.stop()
        thread.join()
    else:
        loop.run()
    dist.barrier()  # no rank closes its connections while another still reads from them
    dist.destroy_process_group()


def bench_tp2_gloo(model: str, steps: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, model, steps, results)) for r in range(2)]
    for p in procs:
        p.start()
    rate = results.get(timeout=600)
    for p in procs:
        p.join()
    return rate


def bench_tp2_ray(model: str, steps: int) -> float:
    import ray
    from ray import serve

    from cluster.app import build_app

    ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        serve.run(
            build_app({**engine_kwargs(model), "tp_size": 2, "grpc": {"port": 0}}), name="bench", route_prefix=None
        )
        handle = serve.get_deployment_handle("LLMServer", app_name="bench")  # the engine replica itself

        async def stream() -> float:
            times = []
            body = {
                "prompt_token_ids": [1, 2, 3, 4],
                "sampling": {"max_new_tokens": steps + 1, "temperature": 0.0, "ignore_eos": True},
            }
            async for _ in handle.options(stream=True).generate.remote(body):
                times.append(time.perf_counter())
            return (len(times) - 1) / (times[-1] - times[0])

        return asyncio.run(stream())
    finally:
        serve.shutdown()
        ray.shutdown()


MODES = {
    "engine": bench_engine,
    "spec_plain": bench_spec_plain,
    "rank_loop": bench_rank_loop,
    "tp2_gloo": bench_tp2_gloo,
    "tp2_ray": bench_tp2_ray,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", default=None)
    add_record_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = tiny_model_dir()
    rows = {}
    for mode in args.modes:
        rows[mode] = MODES[mode](model, args.steps)
        print(f"{mode:10s} {rows[mode]:8.1f} steps/s  {1e3 / rows[mode]:6.2f} ms/step", flush=True)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch_threads": 1,
        "steps": args.steps,
        "steps_per_s": {k: round(v, 1) for k, v in rows.items()},
    }
    emit(result, args.out)
    figures = {mode: {"steps_per_s": rate, "ms_per_step": 1e3 / rate} for mode, rate in rows.items()}
    record_run(args, "control_path", figures, ["steps_per_s", "ms_per_step"], device="cpu")


if __name__ == "__main__":
    main()

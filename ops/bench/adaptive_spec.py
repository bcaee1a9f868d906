"""Adaptive draft length against plain decoding and every fixed draft length, in one run.

    python -m ops.bench.adaptive_spec --out adaptive.json [--parts tiny,shapes] [--record]

1. `tiny`: the shipped tiny target with each of its drafts (standalone, EAGLE, frozen-KV MTP)
   at batches 1, 4, 16 and 64: plain decoding, rounds of a fixed num_steps 1..4, and the adaptive
   controller (num_steps 4). Prompts are Python source text, which the drafts were trained on.
2. `shapes`: the Llama-3-8B and Gemma-3-1B shapes with dummy weights at batches 1, 8 and 64:
   the same modes with a dummy EAGLE head and a dummy frozen-KV MTP head (drafts are not accepted:
   speculation cannot pay), and on the 8B shape a self-draft canary (a standalone draft with the
   target's own dummy weights: drafts accepted, each draft step as dear as a target step).

One engine per draft, built adaptive (num_steps 4): it runs adaptive, then each fixed draft length
through a fixed controller, replaying the graphs it captured for that k, as an engine of that
num_steps would; plain decoding is an engine without a draft, alive throughout. At each batch every
mode runs a warm-up (first replays and, adaptive, the controller's first measurements), then
`--repeats` rounds (5) each time every mode once in turn, plain decoding right before adaptive
(`<draft>/plain`) and, on the tiny part, a second engine without a draft right before plain
(`<draft>/control`), the order reversed every other round (a drift within a round moves every mode
alike): greedy decoding of `--new` tokens per request after a `--prompt`-token prompt (tokens/s of
the decode steps); a case keeps its median run and every run's tokens/s (`tok_per_s_runs`, in round
order; a speculative mode's changes and catch-ups too, `switches_runs` and `catch_ups_runs`). A
host's speed drifts by more than the 3% sought between runs minutes apart (a tiny model's step is
mostly host work: one H200 host ran the same plain steps at 0.40 and 0.89 ms a minute apart, and
0.38 and 0.73 ms within one run), so modes are compared only with runs seconds from theirs: for
each model, draft and batch the table sets adaptive against plain and each fixed length run in the
same round, the median over rounds for each, and takes the least (of medians where the cases'
rounds do not pair up): adaptive against the best mode, which a per-round maximum over the modes
overstates where they are within the host's noise of each other (in every round some mode is
lucky: a max of five runs whose speeds the host halves at random is biased high): the goal is to
be within 3% of it (`of_best`), and at least 97% of plain where drafts are not accepted
(`of_plain`); `control_of_plain` sets the control against plain the same way: what two identical
engines differ by in that run, the resolution of its `of_plain`. Each case is logged and `--out`
rewritten as it is measured, so that a run stopped any way keeps what it measured. With `--pin-cpu
N` the process runs on CPU N alone: on one H200 host two identical plain engines alternated this
way gave medians of their per-round ratios from 0.89 to 1.06 free (interquartile ranges up to 0.26)
and 0.97 to 0.98 pinned (0.04 to 0.08): an unpinned run cannot resolve the 3% sought at batch 1.

Every case's steps' median and 90th percentile (`step_p50_ms`, `step_p90_ms`, from each timed
step's end to the next's: what the mean hides, and a plain engine's steps beside a speculative
engine's plain ones). What the time of a speculative case went to, from each timed step's end to the next's (the
first from its start: not the prefill before it): plain steps (`plain_ms`: per plain decode
step, the launch that restarts overlapped decoding and the commit that drains it included;
`plain_p50_ms`: the median plain step, which leaves out the few that a catch-up held up) and
rounds (`round_ms`, the catch-up before a round after plain steps included), the changes
between them (`switches`), the draft's catch-ups after plain steps and rounds launched ahead
and dropped; for adaptive cases also the controller's cost table for the batch (ms per k, as it
estimates them, beside the start-up priors) and what it measured a switch and a probe from
plain steps to cost beyond their steps (`changes_ms`).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import statistics
import tempfile
import warnings

import numpy as np
import torch

from ops import DEFAULT_MODEL, DRAFT_MODELS
from ops.bench.decode_throughput import SHAPES, random_prompts, timed_decode, write_config
from ops.bench.record import add_record_args, record_run, write_out
from workers.engine import Engine, SamplingParams
from workers.speculative.controller import AdaptiveDraftSteps, DraftSteps, FixedDraftSteps
from workers.speculative.cost_model import EXCURSION, SWITCH

logger = logging.getLogger(__name__)

TINY_BATCHES = (1, 4, 16, 64)
SHAPE_BATCHES = (1, 8, 64)
MAX_STEPS = 4
TOLERANCE = 0.03
REPEATS = 5  # timed runs a case, the median kept
COLUMNS = [
    "tok_per_s",
    "ms_per_step",
    "step_p50_ms",
    "accept_length",
    "draft_steps",
    "plain_share",
    "plain_ms",
    "round_ms",
    "switches",
    "of_best",
    "of_plain",
    "control_of_plain",
]


def modes(engine: Engine) -> list[tuple[str, DraftSteps]]:
    """(name, controller) of every mode of a speculative engine built adaptive: its own
    controller, then every fixed draft length, which replays the graphs captured for that k (a
    round of k drafts is the same as in an engine of num_steps k)."""
    fixed = [(f"k{k}", FixedDraftSteps(k)) for k in range(1, engine.spec.num_steps + 1)]
    return [("adaptive", engine.spec.controller), *fixed]


def decode(engine: Engine, prompts: list[list[int]], new: int) -> dict:
    """Submit, prefill, then time the decode steps: tokens/s, ms per step, accept length, the
    draft steps the requests' decode steps ran (mean, and the share of plain steps), and for a
    speculative engine where the time went (`time_split`)."""
    sampling = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    spec = engine.spec
    steps_run: list[tuple[int | None, int]] = []  # (draft steps, end ns) of each timed step
    starts: list[int] = []  # the first timed step's start: the split leaves the submission and prefill out

    def each_step() -> None:
        if not starts:
            starts.append(engine.last_step.start_ns)
        steps_run.append((engine.last_step.draft_steps, engine.last_step.end_ns))

    before = (spec.catch_ups, spec.drops) if spec is not None else (0, 0)
    outs, tokens, steps, elapsed = timed_decode(engine, prompts, sampling, each_step)
    stats = [o.spec for o in outs if o.spec is not None]
    lengths = [n for s in stats for n in s.accept_lengths]
    drafted = [k for s in stats for k in s.draft_steps + [0] * s.plain_steps]
    out = {
        "tok_per_s": tokens / elapsed,
        "ms_per_step": 1e3 * elapsed / max(1, steps),
        "accept_length": sum(lengths) / len(lengths) if lengths else None,
        "draft_steps": sum(drafted) / len(drafted) if drafted else None,
        "plain_share": drafted.count(0) / len(drafted) if drafted else None,
    }
    out.update(step_quantiles(steps_run, starts[0] if starts else 0))
    if spec is not None:
        out.update(time_split(steps_run, starts[0] if starts else 0))
        out.update(catch_ups=spec.catch_ups - before[0], drops=spec.drops - before[1])
        if isinstance(spec.controller, AdaptiveDraftSteps):
            out.update(cost_table(spec.controller, len(prompts)))
    return out


def time_split(steps_run: list[tuple[int | None, int]], start_ns: int) -> dict:
    """ms per plain decode step and per round, from each step's end to the next's (the first
    from `start_ns`, its start; a step that launched nothing, the drain of overlapped plain
    steps, counts with plain steps), and the changes between plain steps and rounds."""
    plain = rounds = 0.0
    launches = verifies = switches = 0
    last_kind, end, plain_steps = None, start_ns, []
    for k, step_end in steps_run:
        seconds, end = (step_end - end) / 1e9, step_end
        if k:
            rounds, verifies = rounds + seconds, verifies + 1
        else:
            plain, launches = plain + seconds, launches + (k == 0)
            if k == 0:
                plain_steps.append(seconds)
        kind = None if k is None else k > 0
        if kind is not None:
            switches += last_kind is not None and kind != last_kind
            last_kind = kind
    return {
        "plain_ms": 1e3 * plain / launches if launches else None,
        "plain_p50_ms": 1e3 * statistics.median(plain_steps) if plain_steps else None,
        "round_ms": 1e3 * rounds / verifies if verifies else None,
        "switches": switches,
    }


def step_quantiles(steps_run: list[tuple[int | None, int]], start_ns: int) -> dict:
    """The median and 90th percentile of every timed step (from the step before's end; the
    first from `start_ns`), whatever it ran: what a mean hides (a catch-up, a pause of the host)
    and what sets a plain engine's steps beside a speculative engine's plain ones."""
    ends = [start_ns] + [end for _, end in steps_run]
    ms = [(b - a) / 1e6 for a, b in zip(ends, ends[1:])]
    if len(ms) < 2:
        return {"step_p50_ms": ms[0] if ms else None, "step_p90_ms": ms[0] if ms else None}
    return {"step_p50_ms": statistics.median(ms), "step_p90_ms": statistics.quantiles(ms, n=10)[-1]}


def cost_table(controller: AdaptiveDraftSteps, batch: int) -> dict:
    """The controller's view of a batch: ms per k as it estimates them and its start-up priors,
    and what it measured changes to cost beyond their steps."""
    controller.settle()
    costs = controller.costs
    bucket = costs.bucket(batch)
    return {
        "costs_ms": [_ms(c) for c in costs.seconds(batch)],
        "priors_ms": [_ms(costs.prior.get((bucket, k))) for k in range(costs.num_steps + 1)],
        "changes_ms": {kind: _ms(costs.change_seconds(batch, kind)) for kind in (SWITCH, EXCURSION)},
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def run_modes(
    name: str,
    engine: Engine,
    draft: str,
    batches,
    prompts_for,
    new: int,
    out: Results,
    plain=None,
    repeats: int = REPEATS,
    control=None,
) -> None:
    """Every mode of one engine (plain decoding without a draft) at each batch: each mode warmed
    up, then `repeats` rounds that time every mode once in turn (in reverse every other round);
    a case is its mode's run of median tokens/s (a tiny model's step is a few hundred
    microseconds of mostly host work, whose jitter one short run would carry). With `plain` (the
    engine without a draft, alive beside this one) each round times it right before adaptive,
    and those runs make the case `<draft>/plain`: a host whose speed drifts between runs seconds
    apart moves every mode of a batch alike. With `control` (a second engine without a draft)
    each round times it right before plain (`<draft>/control`): set against plain as adaptive
    is, it reads what two identical engines differ by in this run. Cases go into `out` as their
    batch finishes."""
    timed_modes = [(mode, engine, c) for mode, c in modes(engine)] if engine.spec is not None else []
    if plain is not None or engine.spec is None:
        timed_modes = [("plain", plain if plain is not None else engine, None), *timed_modes]
    if control is not None:
        timed_modes = [("control", control, None), *timed_modes]
    for batch in batches:
        prompts = prompts_for(batch)
        runs: dict[str, list[dict]] = {mode: [] for mode, _, _ in timed_modes}
        for repeat in range(repeats + 1):  # the first a warm-up
            for mode, each, controller in timed_modes if repeat % 2 == 0 else timed_modes[::-1]:
                if controller is not None:
                    each.spec.controller = controller
                r = decode(each, prompts, new if repeat else max(8, new // 4))
                if repeat:
                    runs[mode].append(r)
        for mode, timed in runs.items():
            out.add(f"{name}/b{batch}/{draft}/{mode}", _median_run(timed))


class Results(dict):
    """The cases measured so far, written to `path` (with the comparison) as each is added: a
    run stopped any way keeps them."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def add(self, key: str, figures: dict) -> None:
        self[key] = figures
        logger.info("%s: %s", key, json.dumps(figures))
        self.save()

    def save(self) -> None:
        compare(self)
        write_out(self.path, self)


def _median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s, with the range of all and each run's tokens/s in round order,
    and for a speculative mode each run's changes and catch-ups (what a slow run held)."""
    by_round = {f"{name}_runs": [r[name] for r in runs] for name in ("switches", "catch_ups") if name in runs[0]}
    order = [r["tok_per_s"] for r in runs]
    runs = sorted(runs, key=lambda r: r["tok_per_s"])
    r = runs[len(runs) // 2]
    r["tok_per_s_range"] = [runs[0]["tok_per_s"], runs[-1]["tok_per_s"]]
    r["tok_per_s_runs"] = order
    r.update(by_round)
    return r


def close(engine: Engine) -> None:
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(results: dict) -> dict:
    """Adaptive against plain and the best fixed draft length of its model, batch and draft: per
    round against each where every case's rounds pair up (the median over rounds, the least over
    modes), else their median runs."""
    for key, r in results.items():
        model, batch, draft, mode = key.split("/")
        if mode != "adaptive":
            continue
        paired = results.get(f"{model}/{batch}/{draft}/plain")  # timed in the same rounds
        beside = paired or results.get(f"{model}/{batch}/none/plain")
        if beside is None:
            continue
        fixed = [v for k, v in results.items() if k.startswith(f"{model}/{batch}/{draft}/k")]
        rounds = [c.get("tok_per_s_runs") for c in (r, beside, *fixed)]
        if paired and all(rounds) and len({len(c) for c in rounds}) == 1:  # the runs of each round
            mine, plain, *others = (np.array(c) for c in rounds)
            r["of_best"] = float(min(np.median(mine / other) for other in (plain, *others)))
            r["of_plain"] = float(np.median(mine / plain))
            control = results.get(f"{model}/{batch}/{draft}/control", {}).get("tok_per_s_runs")
            if control is not None and len(control) == len(plain):  # identical engines, as this run reads them
                r["control_of_plain"] = float(np.median(np.array(control) / plain))
        else:
            plain = beside["tok_per_s"]
            r["of_best"] = r["tok_per_s"] / max([plain, *(v["tok_per_s"] for v in fixed)])
            r["of_plain"] = r["tok_per_s"] / plain
    return results


def tiny_part(
    device: str,
    batches,
    new: int,
    prompt_len: int,
    drafts: list[str],
    max_steps: int,
    out: Results,
    repeats: int = REPEATS,
) -> None:
    from workers.tokenizer import load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    text = "".join(open(m.__file__).read() for m in (argparse, json.decoder, logging, warnings, tempfile))

    def prompts_for(batch: int) -> list[list[int]]:
        """Windows of the library's source, 1,500 characters apart (wrapping), one a request."""
        starts = [(i * 1500) % (len(text) - 8 * prompt_len) for i in range(batch)]
        return [tok.encode(text[s : s + 8 * prompt_len])[:prompt_len] for s in starts]

    def build(spec: dict | None) -> Engine:
        return Engine(
            model=DEFAULT_MODEL,
            device=device,
            page_size=16,
            max_total_tokens=max(batches) * (prompt_len + new + 64),
            max_running_requests=max(batches),
            speculative=spec,
        )

    plain, control = build(None), build(None)
    run_modes("tiny", plain, "none", batches, prompts_for, new, out, repeats=repeats)
    for draft in drafts:
        spec = {"algorithm": draft, "draft_model": DRAFT_MODELS[draft], "num_steps": max_steps}
        engine = build(spec)
        run_modes("tiny", engine, draft, batches, prompts_for, new, out, plain, repeats, control)
        close(engine)
    close(control)
    close(plain)


def shape_drafts(root: str, shape: str) -> dict[str, dict]:
    """Dummy drafts of a shape: a one-layer EAGLE head, a frozen-KV MTP head (the target's
    default source layers), and on the 8B a self-draft (the target's config and seed)."""
    t = SHAPES[shape]
    eagle = {
        "architectures": ["LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t["head_dim"],
        "vocab_size": t["vocab_size"],
        "rms_norm_eps": t["rms_norm_eps"],
        "max_position_embeddings": t["max_position_embeddings"],
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    mtp = {**t, "architectures": ["FrozenKVMTPForCausalLM"]}
    drafts = {
        "eagle": {"algorithm": "eagle", "draft_model": write_config(root, f"{shape}-eagle", eagle)},
        "frozen_kv_mtp": {"algorithm": "frozen_kv_mtp", "draft_model": write_config(root, f"{shape}-mtp", mtp)},
    }
    if shape == "llama3-8b":
        drafts["self"] = {"algorithm": "standalone", "draft_model": os.path.join(root, shape), "draft_pool": "full"}
    return {name: {"draft_load_format": "dummy", **d} for name, d in drafts.items()}


def shapes_part(
    shapes: list[str],
    batches,
    new: int,
    prompt_len: int,
    drafts: list[str] | None,
    max_steps: int,
    out: Results,
    repeats: int = REPEATS,
) -> None:
    root = tempfile.mkdtemp(prefix="adaptive-shapes-")
    for shape in shapes:
        path = write_config(root, shape, SHAPES[shape])
        vocab = SHAPES[shape]["vocab_size"]

        def build(spec: dict | None, path: str = path) -> Engine:
            return Engine(
                model=path,
                device="cuda",
                dtype="bfloat16",
                load_format="dummy",
                page_size=16,
                swa_full_tokens_ratio=1.0,
                max_total_tokens=max(batches) * (prompt_len + new + 64),
                max_running_requests=max(batches),
                chunked_prefill_size=8192,
                speculative=spec,
            )

        def prompts_for(batch: int, vocab: int = vocab) -> list[list[int]]:
            return random_prompts(vocab, batch, prompt_len)

        plain = build(None)
        run_modes(shape, plain, "none", batches, prompts_for, new, out, repeats=repeats)
        for draft, spec in shape_drafts(root, shape).items():
            if drafts is None or draft in drafts:
                engine = build({**spec, "num_steps": max_steps})
                run_modes(shape, engine, draft, batches, prompts_for, new, out, plain, repeats)
                close(engine)
        close(plain)


def table(results: dict) -> str:
    head = ["tok/s", "ms/step", "p50 ms", "p90 ms", "accept", "k", "plain", "plain ms", "round ms", "switch"]
    head += ["of best", "control"]
    lines = [f"{'case':<40} " + " ".join(f"{h:>9}" for h in head)]
    for key, r in results.items():
        if not isinstance(r, dict) or "tok_per_s" not in r:
            continue
        cells = [
            f"{r['tok_per_s']:.1f}",
            f"{r['ms_per_step']:.3f}",
            _cell(r, "step_p50_ms", ".3f"),
            _cell(r, "step_p90_ms", ".3f"),
            _cell(r, "accept_length", ".2f"),
            _cell(r, "draft_steps", ".2f"),
            f"{100 * r['plain_share']:.0f}%" if r.get("plain_share") is not None else "",
            _cell(r, "plain_ms", ".3f"),
            _cell(r, "round_ms", ".3f"),
            _cell(r, "switches", "d"),
            f"{100 * r['of_best']:.1f}%{'' if r['of_best'] >= 1 - TOLERANCE else ' LOW'}" if "of_best" in r else "",
            f"{100 * r['control_of_plain']:.1f}%" if "control_of_plain" in r else "",
        ]
        lines.append(f"{key:<40} " + " ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)


def _cell(r: dict, name: str, form: str) -> str:
    value = r.get(name)
    return "" if value is None else format(value, form)


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def pin_cpu(cpu: int) -> None:
    """Run this process (and the threads it starts) on `cpu` alone, with one intra-op thread: a
    host-bound step's time then moves less with what the rest of the host does. Intra-op threads
    on the same CPU could only take turns with the one that steps the engine (on a CPU host, two
    threads on one CPU made a round of the tiny target with its MTP head at batch 16 16x slower)."""
    allowed = sorted(os.sched_getaffinity(0))
    if cpu not in allowed:
        raise ValueError(f"--pin-cpu: {cpu}, but this process may run on CPUs {allowed}")
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    logger.info("pinned to CPU %d", cpu)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="tiny,shapes")
    parser.add_argument("--shapes", default="llama3-8b,gemma3-1b")
    parser.add_argument("--drafts", default=None, help="drafts to run, comma-separated (default all of each part)")
    parser.add_argument("--batches", default=None, help="batch sizes, comma-separated (default: each part's)")
    parser.add_argument("--new", type=int, default=128, help="new tokens per request")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS, help="the largest num_steps (adaptive's)")
    parser.add_argument("--device", default="cuda", help="the tiny part's device (cpu: a smoke run)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=REPEATS,
        help="timed runs a case (the median kept)",
    )
    parser.add_argument("--pin-cpu", type=int, default=None, help="run the process on this CPU alone")
    add_record_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.pin_cpu is not None:
        pin_cpu(args.pin_cpu)
    chosen = args.drafts.split(",") if args.drafts else None
    batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    results = Results(args.out)
    signal.signal(signal.SIGTERM, _stop)  # a time limit still leaves the table of the cases measured so far
    try:
        if "tiny" in args.parts.split(","):
            drafts = [d for d in DRAFT_MODELS if chosen is None or d in chosen]
            tiny_part(
                args.device,
                batches or TINY_BATCHES,
                args.new,
                args.prompt,
                drafts,
                args.max_steps,
                results,
                args.repeats,
            )
        if "shapes" in args.parts.split(","):
            shapes = args.shapes.split(",")
            shapes_part(
                shapes, batches or SHAPE_BATCHES, args.new, args.prompt, chosen, args.max_steps, results, args.repeats
            )
    finally:
        results.save()
        print(table(results))
    record_run(args, "adaptive_spec", results, COLUMNS, device=args.device if args.parts == "tiny" else None)


if __name__ == "__main__":
    main()

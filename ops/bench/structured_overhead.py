"""What a JSON-schema grammar costs decoding on one GPU: the same requests with and without
structured outputs, at batches 1 and 64, without speculation and with an EAGLE-3 draft.

    python -m ops.bench.structured_overhead [--shape llama3-8b] [--batches 1,64] [--record]

Dummy weights of a real model shape (`ops/bench/decode_throughput.py`'s shapes and its 8B EAGLE-3
head), bf16, greedy, CUDA graphs on, a 128-token prompt and 128 new tokens. The grammar is a JSON
schema whose output cannot end within them (an array of at least 256 objects), compiled for the
shipped tokenizer with masks as wide as the model's vocabulary, so every step of every request is
masked. Reports decode tokens/s of each case and the grammar's cost over the same case without it
(at most 5% is the goal). With a draft, greedy rounds under the grammar draft freely and mask
only the verify (`json-schema`), and with `--grammar-drafts free,masked` also mask every draft
step on the device (`json-schema+masked-drafts`: `masked_rounds`, the share of decode steps that
did; `masked_ahead`, the share of those whose draft step 2 the round before launched once it was
committed), in the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile

from ops import DEFAULT_MODEL
from ops.bench.decode_throughput import (
    NEW,
    PROMPT,
    SHAPES,
    draft_specs,
    engine_for,
    free,
    random_prompts,
    timed_decode,
    write_config,
)
from ops.bench.record import add_record_args, record_run
from workers.engine import Engine, SamplingParams
from workers.grammar import StructuredOutputs
from workers.tokenizer import TOKENIZER_FILES

SCHEMA = {
    "type": "array",
    "minItems": 256,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        },
        "required": ["id", "name", "tags"],
    },
}
COLUMNS = ["tok_per_s", "ms_per_step", "overhead", "accept_length", "masked_rounds", "masked_ahead"]


def decode(engine: Engine, prompts: list[list[int]], sampling: SamplingParams) -> dict:
    """Prefill, then time the decode steps until every request has its tokens. Under a grammar
    with masked drafts, the rounds must draft on the device (`SpecWorker._masked_round`): the
    share that did is reported, and the share of those whose draft step 2 the round before
    launched."""
    masked = engine.spec.masked_rounds if engine.spec is not None else 0
    ahead = engine.spec.masked_rounds_ahead if engine.spec is not None else 0
    outs, tokens, steps, elapsed = timed_decode(engine, prompts, sampling)
    short = [o.finish_reason for o in outs if len(o.token_ids) < sampling.max_new_tokens]
    assert not short, f"requests ended early: {short}"
    lengths = [n for o in outs if o.spec for n in o.spec.accept_lengths]
    figures = {
        "tok_per_s": tokens / elapsed,
        "ms_per_step": 1e3 * elapsed / max(1, steps),
        "accept_length": sum(lengths) / len(lengths) if lengths else None,
    }
    if engine.spec is not None and engine.spec.drafter.masked_drafts and sampling.structured_outputs is not None:
        masked = engine.spec.masked_rounds - masked
        assert masked > 0, "no round under the grammar drafted on the device"
        figures["masked_rounds"] = masked / max(1, steps)
        figures["masked_ahead"] = (engine.spec.masked_rounds_ahead - ahead) / masked
    return figures


def model_dir(root: str, shape: str) -> str:
    """The shape's config with the shipped tokenizer beside it (its masks padded to the vocabulary)
    and the shipped model's stop token (a grammar ends on one)."""
    with open(f"{DEFAULT_MODEL}/config.json") as f:
        eos = json.load(f)["eos_token_id"]
    path = write_config(root, shape, {**SHAPES[shape], "eos_token_id": eos})
    for name in TOKENIZER_FILES:
        try:
            shutil.copy(f"{DEFAULT_MODEL}/{name}", path)
        except FileNotFoundError:
            continue
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--drafts", default="none,eagle3", help="none and/or draft_specs names (8B shape only)")
    parser.add_argument(
        "--grammar-drafts", default="free", help="free and/or masked: how rounds under the grammar draft (with a draft)"
    )
    add_record_args(parser)
    args = parser.parse_args()
    unknown = set(args.grammar_drafts.split(",")) - {"free", "masked"}
    if unknown:
        raise SystemExit(f"--grammar-drafts: {', '.join(sorted(unknown))} unknown; choose from free, masked")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = tempfile.mkdtemp(prefix="structured-")
    target = model_dir(root, args.shape)
    specs = draft_specs(root) if args.shape == "llama3-8b" else {}
    plain = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    grammar = SamplingParams(
        max_new_tokens=NEW, temperature=0.0, ignore_eos=True, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    figures: dict[str, dict] = {}
    for draft in args.drafts.split(","):
        for batch in map(int, args.batches.split(",")):
            engine = engine_for(target, True, max_batch=max(8, batch), speculative=specs.get(draft))
            prompts = random_prompts(SHAPES[args.shape]["vocab_size"], batch, PROMPT)
            decode(engine, prompts, plain)  # warm-up: first replays
            base = decode(engine, prompts, plain)
            name = f"{args.shape}/{draft} b{batch}"
            figures[f"{name}/plain"] = base
            for mode in args.grammar_drafts.split(",") if engine.spec is not None else ["free"]:
                if engine.spec is not None:
                    engine.spec.drafter.masked_drafts = mode == "masked"
                decode(engine, prompts, grammar)  # warm-up: the grammar compiled and cached, first replays
                got = decode(engine, prompts, grammar)
                got["overhead"] = base["tok_per_s"] / got["tok_per_s"] - 1  # time a token, over plain
                case = f"{name}/json-schema" + ("+masked-drafts" if mode == "masked" else "")
                figures[case] = got
                print(f"{case}: {base['tok_per_s']:.0f} -> {got['tok_per_s']:.0f} tok/s, {got['overhead']:+.1%}")
            free(engine)
            del engine
    record_run(args, "structured_overhead", figures, COLUMNS)


if __name__ == "__main__":
    main()

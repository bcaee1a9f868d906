"""Make a hot-token map for `speculative.token_map`: the `--size` most frequent token ids of a
model's tokenizer over text files like the traffic the deployment serves.

    python -m ops.token_map --model tiny-gemma3 --size 2048 --out hot.json corpus/*.txt

Ties go to the lower id; tokens never seen are not listed (a map may be shorter than --size).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys

from ops import MODELS_DIR
from ops.cli import positive, read_file, run_command
from workers.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def hot_tokens(model: str, paths: list[str], size: int) -> list[int]:
    """The `size` most frequent token ids of `model`'s tokenizer over the files at `paths`."""
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"--model: {model!r} has no tokenizer")
    counts: collections.Counter[int] = collections.Counter()
    for path in paths:
        text = read_file(path, "files", errors="replace")
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [token for token, _ in ranked[:size]]


def run(args: argparse.Namespace) -> int:
    model = args.model if os.path.isdir(args.model) else os.path.join(MODELS_DIR, args.model)
    ids = hot_tokens(model, args.files, args.size)
    try:
        with open(args.out, "w") as f:
            json.dump(ids, f)
    except OSError as exc:
        raise ValueError(f"--out: cannot write {args.out}: {exc.strerror or exc}") from exc
    logger.info("%d token ids written to %s", len(ids), args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model directory, or a shipped model's name")
    p.add_argument("--size", type=positive, required=True, help="tokens to keep (at least 1)")
    p.add_argument("--out", required=True, help="a .json file of token ids")
    p.add_argument("files", nargs="+", help="text files to count tokens over")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_command(run, args)


if __name__ == "__main__":
    sys.exit(main())

"""One MoE layer's experts on the GPU, by path: the GEMV-like kernels, the grouped GEMM and, for
MXFP4, the dequantise-then-GEMM path, at real experts' shapes and growing token counts.

    python -m ops.bench.moe_experts [--shapes gpt-oss-20b,gemma4-26b-a4b] [--weights bf16,mxfp4]
        [--tokens 1,2,4,8,16,32,64,128,300,1024] [--record]

`workers/models/fused_moe.py` chooses a path by the routed (token, expert) pairs of a forward
(`gemv_tiles.moe_path`); this benchmark times every path at every count, so its thresholds
(`GEMV_BELOW_PAIRS`, `DEQUANTIZE_PAIRS_PER_EXPERT`) are read off a record, not guessed.
Routing is uniform over the experts (top-k of random logits), as a dummy-weight decode step's.
Each call is timed as a CUDA graph of back-to-back calls (`xqa_decode_bandwidth.graph_ms`);
`TBps` is the bytes of the distinct experts the routing chose (what a step must read at least)
over the chosen path's time.
"""

from __future__ import annotations

import argparse
import functools
import logging

import torch
import transformers

from ops.bench.decode_throughput import SHAPES
from ops.bench.record import add_record_args, record_run
from ops.bench.xqa_decode_bandwidth import graph_ms
from workers.models import fused_moe, gemv_tiles
from workers.models.config import MoEConfig, model_config_from_hf
from workers.models.moe import Activation
from workers.models.mxfp4 import GROUP, Mxfp4Experts, fill_dummy

logger = logging.getLogger(__name__)

MOE_SHAPES = ("gpt-oss-20b", "gemma4-26b-a4b")  # decode_throughput's shapes with experts
WEIGHTS = ("bf16", "mxfp4")
GEMV_LIMIT = 256  # pairs past which the GEMV path is not timed (it reads an expert per pair)
COLUMNS = ["pairs", "experts_read", "chosen", "chosen_us", "chosen_TBps", "gemv_us", "gemm_us", "dequant_us"]


@functools.cache
def shape_of(name: str) -> tuple[int, MoEConfig]:
    """(hidden size, experts) of a `decode_throughput` shape, as the engine parses its config."""
    config = dict(SHAPES[name])
    cfg = model_config_from_hf(transformers.AutoConfig.for_model(config.pop("model_type"), **config))
    return cfg.hidden_size, cfg.moe


def experts(name: str, weights: str, generator: torch.Generator) -> tuple:
    """(gate_up, down, gate_up bias, down bias) of dummy weights: bf16 normal, or MXFP4 codes."""
    hidden, moe = shape_of(name)
    num, width = moe.num_experts, moe.intermediate_size

    def matrix(out_features: int, in_features: int) -> torch.Tensor | Mxfp4Experts:
        if weights == "bf16":
            return (torch.randn(num, out_features, in_features, device="cuda", generator=generator) * 0.02).to(
                torch.bfloat16
            )
        blocks = torch.empty(num, out_features, in_features // 2, dtype=torch.uint8, device="cuda")
        scales = torch.empty(num, out_features, in_features // GROUP, dtype=torch.uint8, device="cuda")
        fill_dummy(blocks, scales, generator, 0.02)
        return Mxfp4Experts(blocks, scales)

    biases = (torch.zeros(num, 2 * width, dtype=torch.bfloat16, device="cuda"),) if moe.bias else (None,)
    biases += (torch.zeros(num, hidden, dtype=torch.bfloat16, device="cuda"),) if moe.bias else (None,)
    return matrix(2 * width, hidden), matrix(hidden, width), *biases


def expert_bytes(name: str, weights: str) -> int:
    """Bytes of one expert's two matrices as stored."""
    hidden, moe = shape_of(name)
    values = 3 * moe.intermediate_size * hidden
    return values * 2 if weights == "bf16" else values // 2 + values // GROUP


def measure(name: str, weights: str, tokens: int, stored: tuple, generator: torch.Generator) -> dict:
    hidden, moe = shape_of(name)
    num, top_k = moe.num_experts, moe.top_k
    act = Activation(moe.activation, moe.swiglu_alpha, moe.swiglu_limit)
    mxfp4 = weights == "mxfp4"
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).to(torch.bfloat16)
    logits = torch.randn(tokens, num, device="cuda", generator=generator)
    top, ids = torch.topk(logits, top_k)
    routing = torch.softmax(top, -1)
    pairs = tokens * top_k
    chosen = gemv_tiles.moe_path(pairs, num, mxfp4)
    routed_early = name.startswith("gemma4")  # as the family's layer calls them (`fused_experts`)
    row = {"pairs": pairs, "experts_read": int(ids.unique().numel()), "chosen": chosen}
    for path in gemv_tiles.MOE_PATHS:
        if (path == "dequant" and not mxfp4) or (path == "gemv" and pairs > GEMV_LIMIT):
            continue
        calls = 10
        ms = graph_ms(
            [
                lambda path=path: fused_moe.fused_experts(
                    x, *stored[:2], routing, ids, act, *stored[2:], path=path, routed_early=routed_early
                )
            ]
            * calls
        )
        row[f"{path}_us"] = round(ms * 1e3 / calls, 1)
    row["chosen_us"] = row[f"{chosen}_us"]
    row["chosen_TBps"] = round(row["experts_read"] * expert_bytes(name, weights) / row["chosen_us"] / 1e6, 3)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(MOE_SHAPES), help=f"comma-separated, of {', '.join(MOE_SHAPES)}")
    p.add_argument("--weights", default=",".join(WEIGHTS), help="comma-separated, of bf16, mxfp4 (gpt-oss only)")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,300,1024", help="tokens a call, comma-separated")
    add_record_args(p)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shapes, weight_kinds = args.shapes.split(","), args.weights.split(",")
    for field, given, allowed in (("--shapes", shapes, MOE_SHAPES), ("--weights", weight_kinds, WEIGHTS)):
        if unknown := sorted(set(given) - set(allowed)):
            p.error(f"{field}: unknown {unknown}; choose from {list(allowed)}")
    generator = torch.Generator(device="cuda").manual_seed(0)
    cases = {}
    for shape in shapes:
        for weights in weight_kinds:
            if weights == "mxfp4" and shape_of(shape)[1].activation != "swiglu_clamped":
                continue  # MXFP4 experts: gpt-oss's checkpoints only
            stored = experts(shape, weights, generator)
            for tokens in (int(t) for t in args.tokens.split(",")):
                case = f"{shape}/{weights}/{tokens}"
                cases[case] = measure(shape, weights, tokens, stored, generator)
                logger.info("%s %s", case, cases[case])
            del stored
    record_run(args, "moe_experts", cases, COLUMNS)


if __name__ == "__main__":
    main()

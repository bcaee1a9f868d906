"""Kernel sets by hardware (docs/design.md §7), as data: which functions run decode/verify and
context attention, and which features and page sizes each supports."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from attention.kernels import flashinfer_blackwell, flashinfer_hopper, reference
from attention.kernels.calls import ContextCall, DecodeCall, KernelContractError, NewKV, Rotary, chain_mask

__all__ = ["ContextCall", "DecodeCall", "KernelContractError", "KernelSet", "chain_mask", "select_kernels"]


@dataclasses.dataclass(frozen=True)
class KernelSet:
    name: str
    decode_name: str
    context_name: str
    decode: Callable[[DecodeCall, torch.Tensor | None], torch.Tensor]
    context: Callable[[ContextCall, torch.Tensor | None], torch.Tensor]
    decode_softcap: bool  # the decode kernel applies logit soft-capping
    context_softcap: bool
    needs_chain_mask: bool  # verify (q_len_per_req > 1) passes XQA's packed mask
    # Verify-shaped batches (several queries a request) of at most `flat_verify_batch` requests
    # whose page tables span at most `flat_verify_kv` tokens run the decode kernel with one row a
    # query instead, each row's KV ending at its query: causal by lengths, no mask. XQA's
    # multi-query mode is the slower one there; with more requests or longer KV, the faster.
    flat_verify_batch: int
    flat_verify_kv: int
    page_sizes: tuple[int, ...] | None  # None: any page size
    self_checking: bool  # the kernel checks its own contract on every call (the CPU reference)
    # The widest head these kernels are tested with (tests/attention/test_gpu_kernels.py); None: any.
    # Wider heads are refused at start-up rather than risk garbage.
    max_head_dim: int | None = None
    # The widest head the multi-query kernels (context, decode with several queries a request)
    # take. In a model with a wider layer, every layer reads every multi-query forward one query
    # a row through the one-query decode kernel (XQA), each row's KV ending at its query (causal
    # by lengths): forwards mixing the two gave wrong logits on an H200. None: any.
    multi_query_max_head_dim: int | None = None
    # Decode calls of one query a row (decode, flat verify) and at most this many rows run the
    # split-KV Triton kernel instead of `decode` (0: never).
    split_decode_rows: int = 0
    # The same for an FP8 cache, whose XQA kernel reads faster than the split kernel widening
    # FP8 in Triton once the batch fills the device.
    fp8_split_decode_rows: int = 0
    # Head dims at which those split-KV decodes rotate their own query and write the new K and V
    # (`split_decode_rotating`) where a RoPE kernel ran before them.
    rotating_head_dims: tuple[int, ...] = ()
    # Every kernel of the set reads an FP8 (e4m3) cache with the call's scales (docs/design.md
    # §4.7); a set without it refuses `kv_cache_dtype: fp8_e4m3` at start-up.
    fp8_kv: bool = False
    # Whether the FP8 context kernel is right for layers with both logit soft-capping and sinks
    # (no published model has both; FMHA-v2's FP8 variant measured 0.3 relative error there).
    fp8_kv_softcap_with_sinks: bool = True

    def decode_kernel(
        self, rows: int, q_len_per_req: int, split_ok: bool = True, fp8: bool = False
    ) -> tuple[str, Callable]:
        """(name, function) of the kernel a decode-routed call of this shape runs: a function of
        shapes (and of the model and its cache, `split_ok`, `fp8`) only, so eager mode and every
        captured graph agree."""
        if split_ok and q_len_per_req == 1 and rows <= (self.fp8_split_decode_rows if fp8 else self.split_decode_rows):
            return SPLIT_DECODE, _split_decode
        return self.decode_name, self.decode


# (requests, KV tokens) of XQA on an H200, where one row a query beat the multi-query mode for
# Llama-3-8B and Gemma-3 heads (ops/bench/results/verify_attention.history.jsonl); the CPU
# reference follows it, so CI runs the layout the GPU does.
FLAT_VERIFY = (1, 1024)

# Rows up to which the split-KV kernel runs one-query decode on Hopper: it beat XQA's bf16
# kernel at every measured shape (1-64 rows, 256-2,048 tokens; Llama-3-8B and Gemma-3 heads),
# most where XQA leaves SMs idle (one request, few KV heads of 256 dims: 3.4x).
SPLIT_DECODE = "split_kv"
SPLIT_DECODE_ROWS = 256
# With an FP8 cache XQA's kernel read 64 rows of 4,096 tokens in 0.157 ms against the split
# kernel's 0.263 (Llama-3-8B heads; ops/bench/results/xqa_decode_bandwidth.history.jsonl); the
# split kernel keeps the few-row calls where XQA leaves SMs idle (as it does with bf16). Where
# the two cross between 1 and 64 rows is not measured: 16 is 128 (row, KV head) programs of
# Llama-3-8B's heads, about one an SM.
FP8_SPLIT_DECODE_ROWS = 16
# Head dims whose split-KV decode rotates its own query on Hopper: a captured batch-1 step of
# Llama-3-8B with FP8 weights (128 dims) ran 1.012x faster so, Gemma-4-E4B's (256-dim sliding,
# 512-dim full layers) 1.006x slower, though alone the kernel beat RoPE + split-KV decode at both
# (ops/bench/results/decode_step.history.jsonl, xqa_decode_bandwidth.history.jsonl).
# `SLIDESPEC_ROTATING_HEAD_DIMS` (e.g. `128,256`; `none`) overrides it, for tuning in captured steps.
ROTATING_HEAD_DIMS = (128,)


def rotating_head_dims(text: str) -> tuple[int, ...]:
    """`SLIDESPEC_ROTATING_HEAD_DIMS` read (empty: `ROTATING_HEAD_DIMS`; `none`: no head dim)."""
    if not text.strip():
        return ROTATING_HEAD_DIMS
    if text.strip() == "none":
        return ()
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError as e:
        raise ValueError(
            f"SLIDESPEC_ROTATING_HEAD_DIMS: cannot read {text!r}; want head dims like '128,256' or 'none'"
        ) from e
    if any(d <= 0 for d in dims):
        raise ValueError(f"SLIDESPEC_ROTATING_HEAD_DIMS: {text!r}: head dims must be positive")
    return dims


def _split_decode(call: DecodeCall, workspace: torch.Tensor | None) -> torch.Tensor:
    from attention.kernels import split_decode  # Triton ships with CUDA builds of torch only

    return split_decode.decode(call)


def split_decode_rotating(call: DecodeCall, rotary: Rotary, new_kv: NewKV | None) -> torch.Tensor:
    """The split-KV decode rotating its own query and writing the new K and V
    (`split_decode.decode_rotating`): where the routing picks the split-KV kernel for a decode step."""
    from attention.kernels import split_decode

    return split_decode.decode_rotating(call, rotary, new_kv)


def _reference(kind: str) -> Callable:
    fn = getattr(reference, kind)
    return lambda call, workspace: fn(call)


KERNEL_SETS = {
    "cpu": KernelSet(
        "cpu",
        "reference_decode",
        "reference_context",
        _reference("decode"),
        _reference("context"),
        decode_softcap=False,
        context_softcap=True,
        needs_chain_mask=True,
        flat_verify_batch=FLAT_VERIFY[0],
        flat_verify_kv=FLAT_VERIFY[1],
        page_sizes=None,
        self_checking=True,
        multi_query_max_head_dim=256,  # as on Hopper, so CI runs the layout the GPU does
        fp8_kv=True,
    ),
    "sm90": KernelSet(
        "sm90",
        "xqa",
        "fmha_v2",
        flashinfer_hopper.decode,
        flashinfer_hopper.context,
        decode_softcap=False,
        context_softcap=True,
        needs_chain_mask=True,
        flat_verify_batch=FLAT_VERIFY[0],
        flat_verify_kv=FLAT_VERIFY[1],
        page_sizes=(16, 32, 64, 128),
        self_checking=False,
        # XQA and the split-KV decode are exact at 512 dims with one query a row; XQA's
        # multi-query mode refuses heads over 256 and FMHA-v2 gives wrong outputs at 512
        # (tests/attention/test_gpu_kernels.py)
        max_head_dim=512,
        multi_query_max_head_dim=256,
        split_decode_rows=SPLIT_DECODE_ROWS,
        fp8_split_decode_rows=FP8_SPLIT_DECODE_ROWS,
        rotating_head_dims=rotating_head_dims(os.environ.get("SLIDESPEC_ROTATING_HEAD_DIMS", "")),
        fp8_kv=True,  # XQA beside a bf16 query, FMHA-v2 with the query quantised too, split-KV widening
        fp8_kv_softcap_with_sinks=False,
    ),
    "sm100": KernelSet(
        "sm100",
        "trtllm_gen_decode",
        "trtllm_gen_context",
        flashinfer_blackwell.decode,
        flashinfer_blackwell.context,
        decode_softcap=False,
        context_softcap=False,
        needs_chain_mask=False,
        flat_verify_batch=0,
        flat_verify_kv=0,
        page_sizes=(16, 32, 64),
        self_checking=False,
        max_head_dim=256,
    ),
}


def select_kernels(device: torch.device) -> KernelSet:
    if device.type == "cpu":
        return KERNEL_SETS["cpu"]
    major, _ = torch.cuda.get_device_capability(device)
    by_major = {9: "sm90", 10: "sm100"}
    if major not in by_major:
        raise ValueError(
            f"attention_backend: trtllm_mha has no kernels for compute capability {major}.x "
            "(Hopper SM90 and Blackwell SM100/103 only); use torch_native"
        )
    return KERNEL_SETS[by_major[major]]

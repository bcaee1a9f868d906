"""Train the shipped tiny models on the Python standard library's sources (text every machine
with CPython has offline), two sets on one byte-level BPE tokenizer and corpus:

- `gemma3`: a Gemma 3-style hybrid-SWA target and three drafts for it (a standalone model, an
  EAGLE-1 head, a frozen-KV MTP head), distilled from the target;
- `gemma4`: a Gemma 4 target (per-layer embeddings, KV-shared layers, full layers of another
  head size than the sliding ones) and its assistant (`Gemma4AssistantForCausalLM` with a
  centroid head), distilled from it over its own chained drafts.

Targets train as transformers' models; the heads and the assistant train through the same model
code that serves them (attention by `attention.training.TrainingBackend`), so their semantics
cannot drift.

    python -m ops.train_tiny_models prepare --data stdlib.npz      # corpus and configs (CPU)
    python -m ops.train_tiny_models train --data stdlib.npz --out DIR --models gemma4 --device cuda
    python -m ops.train_tiny_models install --out DIR --models gemma4
    python -m ops.train_tiny_models evaluate --data stdlib.npz --models gemma4   # accept lengths, held out

Reproducible for a given CPython version's standard library: files are read in sorted order,
every twentieth (by CRC32 of the path) is held out, and all randomness is seeded. The corpus is
encoded with the shipped tokenizer (`tiny-gemma3`'s, copied into every set's target), so every
set shares it; `prepare --new-tokenizer` trains a new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import math
import os
import shutil
import sysconfig
import time
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ops import MODELS_DIR

logger = logging.getLogger("train_tiny_models")

VOCAB = 2048
SEQ = 256
WINDOW = 64
BATCH = 64
TARGET = "tiny-gemma3"
DRAFTS = {"standalone": "tiny-gemma3-draft", "eagle": "tiny-gemma3-eagle", "frozen_kv_mtp": "tiny-gemma3-mtp"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

TARGET_CONFIG = dict(
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    query_pre_attn_scalar=64,
    sliding_window=WINDOW,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    initializer_range=0.02,
    bos_token_id=None,
    pad_token_id=0,
    eos_token_id=1,
)
DRAFT_CONFIG = {
    **TARGET_CONFIG,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "layer_types": ["sliding_attention", "full_attention"],
}
EAGLE_CONFIG = dict(
    architectures=["LlamaForCausalLMEagle"],
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
    bos_token_id=None,
    eos_token_id=1,
)
MTP_CONFIG = {
    **TARGET_CONFIG,
    "architectures": ["FrozenKVMTPForCausalLM"],
    "kv_source_layers": [4, 5],
    "intermediate_size": 512,
}

# Gemma 4 as Gemma-4-E4B is built, scaled down: sliding layers of 64-wide heads, full layers of
# 128-wide heads with proportional RoPE on a quarter of them, per-layer embeddings, the last two
# layers reading layers 3 and 2's KV (E4B: the last 18 of 42). 3.0M parameters.
GEMMA4_TARGET = "tiny-gemma4"
ASSISTANT = "tiny-gemma4-assistant"
ASSISTANT_STEPS = 4  # drafts a round: the assistant trains over chains this long
GEMMA4_CONFIG = dict(
    architectures=["Gemma4ForCausalLM"],
    model_type="gemma4_text",
    vocab_size=VOCAB,
    hidden_size=192,
    intermediate_size=384,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=128,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=VOCAB,
    attention_k_eq_v=False,
    use_double_wide_mlp=False,
    final_logit_softcapping=30.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    initializer_range=0.02,
    bos_token_id=None,
    pad_token_id=0,
    eos_token_id=1,
)
# Its assistant as Gemma-4-E4B's is built: four query-only layers (three sliding, one full) of
# the target's head shapes, narrower than the target, and a centroid head scoring the tokens of
# 8 of 64 centroids (32 tokens each) a row. 0.9M parameters.
ASSISTANT_CONFIG = dict(
    architectures=["Gemma4AssistantForCausalLM"],
    model_type="gemma4_assistant",
    backbone_hidden_size=GEMMA4_CONFIG["hidden_size"],
    use_ordered_embeddings=True,
    num_centroids=64,
    centroid_intermediate_top_k=8,
    tie_word_embeddings=True,
    text_config=dict(
        model_type="gemma4_text",
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=GEMMA4_CONFIG["num_key_value_heads"],
        head_dim=GEMMA4_CONFIG["head_dim"],
        global_head_dim=GEMMA4_CONFIG["global_head_dim"],
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        num_kv_shared_layers=4,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        attention_k_eq_v=False,
        use_double_wide_mlp=False,
        final_logit_softcapping=None,
        rope_parameters=GEMMA4_CONFIG["rope_parameters"],
        max_position_embeddings=GEMMA4_CONFIG["max_position_embeddings"],
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=None,
        pad_token_id=0,
        eos_token_id=1,
    ),
)

Budget = dict[str, float]  # seconds: target, standalone, heads (the Gemma 4 assistant's is `heads`)


@dataclasses.dataclass(frozen=True)
class ModelSet:
    """A target and its drafts: the directories, their configs, and how they train."""

    target: str
    drafts: dict[str, str]  # speculative algorithm -> directory
    configs: dict[str, dict]  # directory -> config.json
    train: Callable[..., dict[str, dict]]  # (ids, out, device, budget, steps, batch, seq) -> figures per directory

    @property
    def directories(self) -> tuple[str, ...]:
        return (self.target, *self.drafts.values())


# -- prepare -------------------------------------------------------------------------------------
def stdlib_files() -> list[tuple[str, str]]:
    """(path relative to the standard library, text) of every .py file, in sorted order."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if rel.startswith("site-packages"):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            out.append((rel, f.read()))
    return out


def is_held_out(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 20 == 0


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def write_config(root: str, name: str, config: dict) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def prepare(data: str, sets: list[str], new_tokenizer: bool = False, models_dir: str = MODELS_DIR) -> None:
    """Encode the corpus into `data` (npz: train, held_out), write the sets' configs and give
    each set's target the shared tokenizer."""
    from transformers import AutoTokenizer

    files = stdlib_files()
    train_texts = [t for rel, t in files if not is_held_out(rel)]
    held_texts = [t for rel, t in files if is_held_out(rel)]
    logger.info("%d files (%d held out), %.1f MB", len(files), len(held_texts), sum(map(len, train_texts)) / 1e6)
    shared = os.path.join(models_dir, TARGET)
    if new_tokenizer:
        train_tokenizer(train_texts).save_pretrained(shared)
    tokenizer = AutoTokenizer.from_pretrained(shared)
    eos = tokenizer.eos_token_id

    def encode(texts: list[str]) -> np.ndarray:
        return np.asarray([i for ids in tokenizer(texts)["input_ids"] for i in ids + [eos]], dtype=np.uint16)

    train, held = encode(train_texts), encode(held_texts)
    np.savez_compressed(data, train=train, held_out=held)
    logger.info("tokens: %d train, %d held out -> %s", len(train), len(held), data)
    for s in (SETS[name] for name in sets):
        for name, config in s.configs.items():
            write_config(models_dir, name, config)
        for file in TOKENIZER_FILES:
            if s.target != TARGET and os.path.isfile(os.path.join(shared, file)):
                shutil.copy(os.path.join(shared, file), os.path.join(models_dir, s.target, file))


# -- training ------------------------------------------------------------------------------------
def batches(ids: np.ndarray, batch: int, seq: int, seed: int, device: str) -> Iterator[torch.Tensor]:
    """Random windows of `seq + 1` tokens, `batch` a draw."""
    rng = np.random.default_rng(seed)
    data = torch.from_numpy(ids.astype(np.int64))
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        yield torch.stack([data[s : s + seq + 1] for s in starts]).to(device)


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))


def run_training(name: str, params, loss_fn, data, steps: int, seconds: float, lr: float) -> dict:
    """AdamW with warm-up and cosine decay for `steps` steps or `seconds`, whichever ends first
    (none with `steps` 0: the weights stay as initialised). Returns steps, seconds, last loss."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    start = time.monotonic()
    done, loss = 0, None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        loss = loss_fn(next(data))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        done = step + 1
        if step % 100 == 0:
            logger.info("%s step %d loss %.3f (%.0f s)", name, step, loss.item(), time.monotonic() - start)
        if time.monotonic() - start > seconds:
            break
    final = None if loss is None else round(loss.item(), 3)
    logger.info("%s: %d steps in %.0f s, last loss %s", name, done, time.monotonic() - start, final)
    return {
        "parameters_m": round(sum(p.numel() for p in params) / 1e6, 2),
        "steps": done,
        "seconds": round(time.monotonic() - start),
        "final_loss": final,
    }


def _autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)


def _kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    return F.kl_div(
        F.log_softmax(student_logits.float(), -1),
        F.log_softmax(teacher_logits.float(), -1),
        log_target=True,
        reduction="batchmean",
    )


def train_hf(config: dict, data, steps: int, seconds: float, lr: float, device: str, teacher=None):
    """A Hugging Face model of `config` (its `model_type`'s classes): next-token loss, or
    distillation from `teacher`. Returns the model and its training figures."""
    import transformers

    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    cfg = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device).train()

    def loss_fn(tokens):
        with _autocast(device):
            logits = model(tokens[:, :-1]).logits
            if teacher is None:
                return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            with torch.no_grad():
                target_logits = teacher(tokens[:, :-1]).logits
            return _kl(logits.flatten(0, 1), target_logits.flatten(0, 1))

    name = "target" if teacher is None else "standalone draft"
    figures = run_training(name, list(model.parameters()), loss_fn, data, steps, seconds, lr)
    return model.eval(), figures


def training_batch(tokens: torch.Tensor, backend, query_offset: int = 0, spec_hidden: torch.Tensor | None = None):
    """A ForwardBatch of whole sequences (one row each) through `attention.training.TrainingBackend`."""
    from attention import ForwardMode
    from workers.forward_batch import DeviceInputs, ForwardBatch

    b, t = tokens.shape
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=b,
        q_lens_cpu=[t] * b,
        seq_lens_cpu=[t] * b,
        req_to_token=torch.zeros(0),
        inputs=DeviceInputs(
            input_ids=tokens.flatten(),
            positions=torch.arange(t, device=tokens.device).repeat(b),
            out_cache_loc=torch.zeros(0, dtype=torch.int64),
            req_pool_indices=torch.zeros(0),
            logits_indices=torch.arange(b * t, device=tokens.device),
        ),
        query_offset=query_offset,
        spec_hidden=spec_hidden,
        attn_backend=backend,
    )
    backend.init_forward_metadata(batch, None)
    return batch


def load_target(target_dir: str, device: str):
    """Our model of a trained target (float32), and a training backend for its passes."""
    from attention.training import TrainingBackend
    from workers.models import build_model, load_model_config

    dev = torch.device(device)
    cfg = load_model_config(target_dir)
    return build_model(cfg, target_dir, "auto", torch.float32, dev), TrainingBackend(dev)


def target_pass(target, backend, tokens: torch.Tensor, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final-norm hidden states `[B, T, H]` (float32) and logits `[B, T, V]` over
    `tokens`; its K/V stay in `backend` for heads that read them. Its weights require no
    gradient, so nothing is recorded; with grad mode on, its ops are the torch ones (the
    reference the fused kernels are tested against), on the GPU as in the CPU tests."""
    with torch.enable_grad(), _autocast(device):
        hidden, _ = target(training_batch(tokens, backend))
        logits = target.compute_logits(hidden)
    b, t = tokens.shape
    return hidden.view(b, t, -1).float(), logits.view(b, t, -1)


def _trainable(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    from workers.models.loader import init_dummy_weights

    init_dummy_weights(module, seed, 0.02)
    module.train()
    for p in module.parameters():
        p.requires_grad_(True)
    return module


def train_heads(
    target_dir: str, data, steps: int, seconds: float, lr: float, device: str, models_dir: str = MODELS_DIR
) -> tuple[dict[str, torch.nn.Module], dict[str, dict]]:
    """EAGLE-1 and frozen-KV MTP heads on our target (loaded from its checkpoint), distilled from it."""
    from workers.models.eagle import EagleHead, load_eagle_config
    from workers.models.frozen_kv_mtp import FrozenKVMTPHead, frozen_kv_config

    target, backend = load_target(target_dir, device)
    cfg = target.cfg
    with torch.device(device):
        eagle = EagleHead(
            load_eagle_config(os.path.join(models_dir, DRAFTS["eagle"]), cfg, "dummy"), target, _single_rank()
        )
        mtp_cfg, sources = frozen_kv_config(os.path.join(models_dir, DRAFTS["frozen_kv_mtp"]), cfg)
        mtp = FrozenKVMTPHead(mtp_cfg, sources, target, _single_rank())
    heads = {"eagle": eagle, "frozen_kv_mtp": mtp}
    for seed, head in enumerate(heads.values()):
        _trainable(head, seed)

    def eagle_loss(tokens):
        hidden, logits = target_pass(target, backend, tokens[:, :-1], device)
        # Entry i: token i + 1 and the target's hidden state at i.
        batch = training_batch(tokens[:, 1:-1], backend, spec_hidden=hidden[:, :-1].flatten(0, 1))
        with _autocast(device):
            out, _ = eagle(batch)
            student = eagle.compute_logits(out)
        return _kl(student, logits[:, 1:].flatten(0, 1))

    def mtp_loss(tokens):
        hidden, logits = target_pass(target, backend, tokens[:, :-1], device)  # also leaves its K/V in the backend
        b, t = hidden.shape[:2]
        batch = training_batch(tokens[:, :-1], backend, query_offset=1, spec_hidden=_previous(hidden).flatten(0, 1))
        with _autocast(device):
            out, _ = mtp(batch)
            student = mtp.compute_logits(out).view(b, t, -1)
        return _kl(student[:, 1:].flatten(0, 1), logits[:, 1:].flatten(0, 1))  # row 0 has no verified key

    figures = {
        DRAFTS["eagle"]: run_training("eagle head", list(eagle.parameters()), eagle_loss, data, steps, seconds, lr),
        DRAFTS["frozen_kv_mtp"]: run_training(
            "frozen-KV MTP head", list(mtp.parameters()), mtp_loss, data, steps, seconds, lr
        ),
    }
    return heads, figures


def _previous(hidden: torch.Tensor) -> torch.Tensor:
    """Row p: the hidden state at p - 1 (zeros at 0), `[B, T, H]`."""
    return torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)


def _single_rank():
    from workers.distributed import SINGLE_RANK

    return SINGLE_RANK


def checkpoint_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters under their checkpoint names: fused q/k/v and gate/up split back."""
    from workers.models.layers import ColumnParallelLinear, QKVParallelLinear

    out = {}
    for prefix, sub in module.named_modules():
        own = {f"{prefix}.{n}" if prefix else n: p for n, p in sub.named_parameters(recurse=False)}
        if isinstance(sub, (QKVParallelLinear, ColumnParallelLinear)) and len(sub.local_sizes) > 1:
            names = ("q_proj", "k_proj", "v_proj") if isinstance(sub, QKVParallelLinear) else ("gate_proj", "up_proj")
            base = prefix.rsplit(".", 1)[0]
            for part, tensor in zip(names, sub.weight.split(sub.local_sizes)):
                out[f"{base}.{part}.weight"] = tensor
            continue
        out.update(own)
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


def train_gemma3(ids, out: str, device: str, budget: Budget, steps: int, batch: int, seq: int) -> dict[str, dict]:
    data = batches(ids, batch, seq, seed=0, device=device)
    target, figures = train_hf(TARGET_CONFIG, data, steps, budget["target"], 3e-3, device)
    target_dir = os.path.join(out, TARGET)
    target.to(torch.bfloat16).save_pretrained(target_dir)
    target.float()
    draft, figures_draft = train_hf(DRAFT_CONFIG, data, steps, budget["standalone"], 3e-3, device, teacher=target)
    draft.to(torch.bfloat16).save_pretrained(os.path.join(out, DRAFTS["standalone"]))
    heads, figures_heads = train_heads(target_dir, data, steps, budget["heads"], 2e-3, device)
    for (algorithm, head), config in zip(heads.items(), (EAGLE_CONFIG, MTP_CONFIG)):
        path = write_config(out, DRAFTS[algorithm], config)
        save_file(checkpoint_tensors(head), os.path.join(path, "model.safetensors"))
    return {TARGET: figures, DRAFTS["standalone"]: figures_draft, **figures_heads}


# -- Gemma 4 and its assistant -------------------------------------------------------------------
def balanced_clusters(rows: torch.Tensor, blocks: int) -> torch.Tensor:
    """Every row index once, in `blocks` equal blocks of similar rows: each group halved along
    its principal direction until there are `blocks` (a power of two). The centroid head's
    `token_ordering` from the target's LM-head rows: tokens a context predicts together share
    a centroid, so a few centroids hold most of the target's probability."""
    if blocks & (blocks - 1) or rows.shape[0] % blocks:
        raise ValueError(f"num_centroids {blocks} must be a power of two dividing the vocabulary ({rows.shape[0]})")
    groups = [torch.arange(rows.shape[0])]
    while len(groups) < blocks:
        halves = []
        for ids in groups:
            x = rows[ids].float() - rows[ids].float().mean(0)
            direction = torch.ones(x.shape[1])
            for _ in range(32):  # power iteration: the leading right singular vector
                direction = x.T @ (x @ direction)
                direction /= direction.norm().clamp_min(1e-30)
            order = ids[(x @ direction).argsort(stable=True)]
            halves += [order[: len(order) // 2], order[len(order) // 2 :]]
        groups = halves
    return torch.cat(groups)


def assistant_steps(assistant, tokens: torch.Tensor, hidden: torch.Tensor, backend, steps: int) -> list:
    """The assistant's draft steps 1..`steps` at every position p of a target pass over
    `tokens[:, :T]` (its K/V in `backend`, its final-norm states `hidden` `[B, T, H]`): step j
    reads token p + j - 1 and, first, the target's state at p - 1, later its own; every step
    sits at p and sees the target's keys before p, as the drafts of a round do (docs/design.md
    §6). Returns each step's (final-norm hidden states, state handed on), rows `[B * T]`."""
    t = hidden.shape[1]
    state = _previous(hidden).flatten(0, 1)
    out = []
    for j in range(steps):
        normed, state = assistant(training_batch(tokens[:, j : j + t], backend, query_offset=1, spec_hidden=state))
        out.append((normed, state))
    return out


def train_assistant(
    target_dir: str, assistant_dir: str, data, steps: int, seconds: float, lr: float, device: str
) -> tuple[torch.nn.Module, dict]:
    """Gemma 4's assistant on our target, distilled from it over chains of `ASSISTANT_STEPS`
    drafts fed the data's tokens: each step's logits (over the whole vocabulary, in token order)
    by KL to the target's at the token it predicts, and its centroid scores by KL to the target's
    probability mass per centroid. Rows of `data` hold `SEQ + ASSISTANT_STEPS` tokens."""
    from workers.models.gemma4_assistant import Gemma4Assistant, assistant_config

    target, backend = load_target(target_dir, device)
    ac = assistant_config(assistant_dir, target.cfg)
    with torch.device(device):
        assistant = _trainable(Gemma4Assistant(ac, target, _single_rank()), seed=0)
    head = assistant.masked_embedding
    ordering = balanced_clusters(target.lm_head.weight.detach().cpu(), ac.num_centroids).to(device)
    head.token_ordering.copy_(ordering)
    in_token_order = ordering.argsort()

    def loss_fn(tokens):
        t = tokens.shape[1] - ASSISTANT_STEPS + 1
        hidden, teacher = target_pass(target, backend, tokens[:, :t], device)
        with _autocast(device):
            chain = assistant_steps(assistant, tokens, hidden, backend, ASSISTANT_STEPS)
        loss = 0.0
        for j, (normed, _) in enumerate(chain):  # rows p >= 1 (a verified key) whose token p + j was scored
            rows = normed.view(tokens.shape[0], t, -1)[:, 1 : t - j].flatten(0, 1).float()
            wanted = teacher[:, 1 + j :].flatten(0, 1).float()
            loss = loss + _kl((rows @ head.weight.T)[:, in_token_order], wanted)
            mass = wanted.softmax(-1)[:, ordering].view(len(rows), ac.num_centroids, -1).sum(-1)
            loss = loss + F.kl_div(F.log_softmax(head.centroids(rows), -1), mass, reduction="batchmean")
        return loss / ASSISTANT_STEPS

    figures = run_training("assistant", list(assistant.parameters()), loss_fn, data, steps, seconds, lr)
    return assistant.eval(), figures


def assistant_tensors(assistant) -> dict[str, torch.Tensor]:
    """The checkpoint of `Gemma4AssistantForCausalLM`: the LM head as `model.embed_tokens.weight`
    in token order, the centroid head's `token_ordering`."""
    tensors = checkpoint_tensors(assistant)
    ordering = assistant.masked_embedding.token_ordering
    tensors["model.embed_tokens.weight"] = tensors.pop("masked_embedding.weight")[ordering.argsort().cpu()]
    tensors["masked_embedding.token_ordering"] = ordering.cpu().contiguous()
    return tensors


def train_gemma4(ids, out: str, device: str, budget: Budget, steps: int, batch: int, seq: int) -> dict[str, dict]:
    data = batches(ids, batch, seq, seed=0, device=device)
    target, figures = train_hf(GEMMA4_CONFIG, data, steps, budget["target"], 3e-3, device)
    target_dir = os.path.join(out, GEMMA4_TARGET)
    target.to(torch.bfloat16).save_pretrained(target_dir)
    del target
    assistant_dir = write_config(out, ASSISTANT, ASSISTANT_CONFIG)
    data = batches(ids, batch, seq + ASSISTANT_STEPS - 1, seed=1, device=device)
    assistant, figures_assistant = train_assistant(
        target_dir, assistant_dir, data, steps, budget["heads"], 2e-3, device
    )
    save_file(assistant_tensors(assistant), os.path.join(assistant_dir, "model.safetensors"))
    return {GEMMA4_TARGET: figures, ASSISTANT: figures_assistant}


SETS = {
    "gemma3": ModelSet(
        TARGET,
        DRAFTS,
        {
            TARGET: TARGET_CONFIG,
            DRAFTS["standalone"]: DRAFT_CONFIG,
            DRAFTS["eagle"]: EAGLE_CONFIG,
            DRAFTS["frozen_kv_mtp"]: MTP_CONFIG,
        },
        train_gemma3,
    ),
    "gemma4": ModelSet(
        GEMMA4_TARGET,
        {"mtp": ASSISTANT},
        {GEMMA4_TARGET: GEMMA4_CONFIG, ASSISTANT: ASSISTANT_CONFIG},
        train_gemma4,
    ),
}


def train(
    data_path: str,
    out: str,
    device: str,
    budget: Budget,
    sets: list[str],
    steps: int = 100000,
    batch: int = BATCH,
    seq: int = SEQ,
) -> dict[str, dict]:
    """Train the sets into `out` (one directory per model); returns each model's figures,
    also written to `out/summary.json`."""
    torch.manual_seed(0)
    ids = np.load(data_path)["train"]
    figures = {}
    for name in sets:
        figures.update(SETS[name].train(ids, out, device, budget, steps, batch, seq))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(figures, f, indent=1)
    return figures


def install(out: str, sets: list[str], models_dir: str = MODELS_DIR) -> None:
    """Copy trained weights (a `train` output directory) next to the shipped configs."""
    for name in (d for s in sets for d in SETS[s].directories):
        weights = os.path.join(name, "model.safetensors")
        shutil.copyfile(os.path.join(out, weights), os.path.join(models_dir, weights))


# -- evaluation ----------------------------------------------------------------------------------
def evaluate(
    data_path: str,
    sets: list[str],
    prompts: int,
    prompt_len: int,
    new_tokens: int,
    num_steps: int,
    models_dir: str = MODELS_DIR,
) -> dict:
    """Mean accept length per set and algorithm with `num_steps` drafts, greedy, on held-out
    files (engines on the CPU, float32)."""
    from workers.engine import Engine, SamplingParams

    held = np.load(data_path)["held_out"].astype(np.int64)
    stride = (len(held) - prompt_len) // prompts
    batch = [held[i * stride : i * stride + prompt_len].tolist() for i in range(prompts)]
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    result = {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens, "num_steps": num_steps}
    for s in (SETS[name] for name in sets):
        target = os.path.join(models_dir, s.target)
        start = time.perf_counter()
        ref = Engine(model=target, max_total_tokens=32768).generate(prompt_token_ids=batch, sampling=sp)
        result[f"{s.target}/none"] = {"seconds": round(time.perf_counter() - start, 2)}
        for algorithm, name in s.drafts.items():
            draft = os.path.join(models_dir, name)
            spec = {"algorithm": algorithm, "draft_model": draft, "num_steps": num_steps, "adaptive": False}
            eng = Engine(model=target, max_total_tokens=32768, speculative=spec)
            start = time.perf_counter()
            outs = eng.generate(prompt_token_ids=batch, sampling=sp)
            lengths = [n for o in outs for n in o.spec.accept_lengths]
            result[f"{s.target}/{algorithm}"] = {
                "accept_length": round(sum(lengths) / len(lengths), 3),
                "verify_steps": len(lengths),
                "seconds": round(time.perf_counter() - start, 2),
                "lossless": [o.token_ids for o in outs] == [o.token_ids for o in ref],
            }
    return result


def _sets(value: str) -> list[str]:
    names = value.split(",")
    if not names or any(n not in SETS for n in names):
        raise argparse.ArgumentTypeError(f"{value!r}: a comma-separated list of {', '.join(SETS)}")
    return names


def _record(args: argparse.Namespace, figures: dict, device: str, note: str) -> None:
    """The run in `ops/bench/results/tiny_models.*` when `--record` or `--not-kept` asks."""
    from ops.bench.record import RESULTS_DIR, command_line, machine_name, record

    if args.record is None and args.not_kept is None:
        return
    cases = {k: v for k, v in figures.items() if isinstance(v, dict)}
    record(
        "tiny_models",
        cases,
        command_line("ops.train_tiny_models"),
        machine=machine_name(device),
        kept=args.not_kept is None,
        why=args.not_kept,
        results_dir=args.record or RESULTS_DIR,
        date=args.record_date,
        rev=args.record_revision,
        note=note,
    )


def main() -> None:
    from ops.bench.record import add_record_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    every = ",".join(SETS)
    p = sub.add_parser("prepare")
    p.add_argument("--data", required=True)
    p.add_argument("--models", type=_sets, default=every, help="sets whose configs and tokenizer to write")
    p.add_argument("--new-tokenizer", action="store_true", help="train a new tokenizer instead of the shipped one")
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--models", type=_sets, default=every)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--target-seconds", type=float, default=240)
    t.add_argument("--draft-seconds", type=float, default=60)
    t.add_argument("--head-seconds", type=float, default=60, help="each head's, and the Gemma 4 assistant's")
    t.add_argument("--max-steps", type=int, default=100000, help="0: save the models as initialised")
    add_record_args(t)
    i = sub.add_parser("install")
    i.add_argument("--out", required=True)
    i.add_argument("--models", type=_sets, default=every)
    e = sub.add_parser("evaluate")
    e.add_argument("--data", required=True)
    e.add_argument("--models", type=_sets, default=every)
    e.add_argument("--prompts", type=int, default=16)
    e.add_argument("--prompt-len", type=int, default=192)
    e.add_argument("--new-tokens", type=int, default=64)
    e.add_argument("--num-steps", type=int, default=4)
    add_record_args(e)
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s: %(message)s")
    if args.command == "prepare":
        prepare(args.data, args.models, args.new_tokenizer)
    elif args.command == "train":
        budget = {"target": args.target_seconds, "standalone": args.draft_seconds, "heads": args.head_seconds}
        figures = train(args.data, args.out, args.device, budget, args.models, args.max_steps)
        precision = "bf16 autocast" if args.device == "cuda" else "float32"
        _record(args, figures, args.device, f"CPython standard library sources, the shipped BPE; {precision}")
    elif args.command == "install":
        install(args.out, args.models)
    else:
        result = evaluate(args.data, args.models, args.prompts, args.prompt_len, args.new_tokens, args.num_steps)
        print(json.dumps(result, indent=1))
        note = f"{args.prompts} held-out prompts of {args.prompt_len} tokens, {args.new_tokens} greedy new tokens"
        _record(args, result, "cpu", note)  # the engines run on the CPU, float32


if __name__ == "__main__":
    main()

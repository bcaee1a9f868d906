"""Train the shipped tiny models on the Python standard library's sources (text every machine
with CPython has offline): a byte-level BPE tokenizer, a Gemma 3-style hybrid-SWA target and
three drafts for it (a standalone model, an EAGLE-1 head, a frozen-KV MTP head), distilled from
the target. The heads train through the same model code that serves them (attention by
`attention.training.TrainingBackend`), so their semantics cannot drift.

    python -m ops.train_tiny_models prepare --data /tmp/stdlib.npz      # corpus, tokenizer, configs (CPU)
    python -m ops.train_tiny_models train --data /tmp/stdlib.npz --out DIR --device cuda
    python -m ops.train_tiny_models evaluate --data /tmp/stdlib.npz      # accept lengths on held-out files

Reproducible for a given CPython version's standard library: files are read in sorted order,
every twentieth (by CRC32 of the path) is held out, and all randomness is seeded.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import math
import os
import shutil
import sysconfig
import time
import zlib

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ops import MODELS_DIR

logger = logging.getLogger("train_tiny_models")

VOCAB = 2048
SEQ = 256
WINDOW = 64
TARGET = "tiny-gemma3"
DRAFTS = {"standalone": "tiny-gemma3-draft", "eagle": "tiny-gemma3-eagle", "frozen_kv_mtp": "tiny-gemma3-mtp"}

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


def prepare(data: str) -> None:
    files = stdlib_files()
    train_texts = [t for rel, t in files if not is_held_out(rel)]
    held_texts = [t for rel, t in files if is_held_out(rel)]
    logger.info("%d files (%d held out), %.1f MB", len(files), len(held_texts), sum(map(len, train_texts)) / 1e6)
    tokenizer = train_tokenizer(train_texts)
    eos = tokenizer.eos_token_id

    def encode(texts: list[str]) -> np.ndarray:
        ids = []
        for text in texts:
            ids += tokenizer.encode(text) + [eos]
        return np.asarray(ids, dtype=np.uint16)

    train, held = encode(train_texts), encode(held_texts)
    np.savez_compressed(data, train=train, held_out=held)
    logger.info("tokens: %d train, %d held out -> %s", len(train), len(held), data)
    for name, config in (
        (TARGET, TARGET_CONFIG),
        (DRAFTS["standalone"], DRAFT_CONFIG),
        (DRAFTS["eagle"], EAGLE_CONFIG),
        (DRAFTS["frozen_kv_mtp"], MTP_CONFIG),
    ):
        path = os.path.join(MODELS_DIR, name)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    tokenizer.save_pretrained(os.path.join(MODELS_DIR, TARGET))


# -- training ------------------------------------------------------------------------------------
def batches(ids: np.ndarray, batch: int, seq: int, seed: int, device: str):
    rng = np.random.default_rng(seed)
    data = torch.from_numpy(ids.astype(np.int64))
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        yield torch.stack([data[s : s + seq + 1] for s in starts]).to(device)


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))


def run_training(name: str, params, loss_fn, data, steps: int, seconds: float, lr: float) -> None:
    """AdamW with warm-up and cosine decay for `steps` steps or `seconds`, whichever ends first."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    start = time.monotonic()
    step = 0
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        loss = loss_fn(next(data))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 100 == 0:
            logger.info("%s step %d loss %.3f (%.0f s)", name, step, loss.item(), time.monotonic() - start)
        if time.monotonic() - start > seconds:
            break
    logger.info("%s: %d steps in %.0f s, last loss %.3f", name, step + 1, time.monotonic() - start, loss.item())


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
    """A Hugging Face Gemma 3 model: next-token loss, or distillation from `teacher`."""
    import transformers

    cfg = transformers.Gemma3TextConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).to(device).train()

    def loss_fn(tokens):
        with _autocast(device):
            logits = model(tokens[:, :-1]).logits
            if teacher is None:
                return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            with torch.no_grad():
                target_logits = teacher(tokens[:, :-1]).logits
            return _kl(logits.flatten(0, 1), target_logits.flatten(0, 1))

    run_training(
        "target" if teacher is None else "standalone draft", list(model.parameters()), loss_fn, data, steps, seconds, lr
    )
    return model.eval()


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


def train_heads(
    target_dir: str, data, steps: int, seconds: float, lr: float, device: str
) -> dict[str, torch.nn.Module]:
    """EAGLE-1 and frozen-KV MTP heads on our target (loaded from its checkpoint), distilled from it."""
    from attention.training import TrainingBackend
    from workers.models import build_model, load_model_config
    from workers.models.eagle import EagleHead, load_eagle_config
    from workers.models.frozen_kv_mtp import FrozenKVMTPHead, frozen_kv_config
    from workers.models.loader import init_dummy_weights

    dev = torch.device(device)
    cfg = load_model_config(target_dir)
    target = build_model(cfg, target_dir, "auto", torch.float32, dev)
    backend = TrainingBackend(dev)
    with torch.device(dev):
        eagle = EagleHead(
            load_eagle_config(os.path.join(MODELS_DIR, DRAFTS["eagle"]), cfg, "dummy"), target, _single_rank()
        )
        mtp_cfg, sources = frozen_kv_config(os.path.join(MODELS_DIR, DRAFTS["frozen_kv_mtp"]), cfg)
        mtp = FrozenKVMTPHead(mtp_cfg, sources, target, _single_rank())
    heads = {"eagle": eagle, "frozen_kv_mtp": mtp}
    for seed, head in enumerate(heads.values()):
        init_dummy_weights(head, seed, 0.02)
        head.train()
        for p in head.parameters():
            p.requires_grad_(True)

    def target_pass(tokens):
        with torch.no_grad(), _autocast(device):
            hidden, _ = target(training_batch(tokens[:, :-1], backend))
            logits = target.compute_logits(hidden)
        b, t = tokens.shape[0], tokens.shape[1] - 1
        return hidden.view(b, t, -1).float(), logits.view(b, t, -1)

    def eagle_loss(tokens):
        hidden, logits = target_pass(tokens)
        # Entry i: token i + 1 and the target's hidden state at i.
        batch = training_batch(tokens[:, 1:-1], backend, spec_hidden=hidden[:, :-1].flatten(0, 1))
        with _autocast(device):
            out, _ = eagle(batch)
            student = eagle.compute_logits(out)
        return _kl(student, logits[:, 1:].flatten(0, 1))

    def mtp_loss(tokens):
        hidden, logits = target_pass(tokens)  # also leaves the target's K/V in the backend
        b, t = hidden.shape[:2]
        previous = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)  # row p: hidden state at p - 1
        batch = training_batch(tokens[:, :-1], backend, query_offset=1, spec_hidden=previous.flatten(0, 1))
        with _autocast(device):
            out, _ = mtp(batch)
            student = mtp.compute_logits(out).view(b, t, -1)
        return _kl(student[:, 1:].flatten(0, 1), logits[:, 1:].flatten(0, 1))  # row 0 has no verified key

    run_training("eagle head", list(eagle.parameters()), eagle_loss, data, steps, seconds, lr)
    run_training("frozen-KV MTP head", list(mtp.parameters()), mtp_loss, data, steps, seconds, lr)
    return heads


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


def train(data_path: str, out: str, device: str, budget: dict[str, float]) -> None:
    torch.manual_seed(0)
    ids = np.load(data_path)["train"]
    data = batches(ids, 64, SEQ, seed=0, device=device)
    target = train_hf(TARGET_CONFIG, data, 100000, budget["target"], 3e-3, device)
    target_dir = os.path.join(out, TARGET)
    target.to(torch.bfloat16).save_pretrained(target_dir)
    target.float()
    draft = train_hf(DRAFT_CONFIG, data, 100000, budget["standalone"], 3e-3, device, teacher=target)
    draft.to(torch.bfloat16).save_pretrained(os.path.join(out, DRAFTS["standalone"]))
    heads = train_heads(target_dir, data, 100000, budget["heads"], 2e-3, device)
    for algorithm, head in heads.items():
        path = os.path.join(out, DRAFTS[algorithm])
        os.makedirs(path, exist_ok=True)
        save_file(checkpoint_tensors(head), os.path.join(path, "model.safetensors"))


def install(out: str) -> None:
    """Copy trained weights (a `train` output directory) next to the shipped configs."""
    for name in (TARGET, *DRAFTS.values()):
        shutil.copy(os.path.join(out, name, "model.safetensors"), os.path.join(MODELS_DIR, name, "model.safetensors"))


# -- evaluation ----------------------------------------------------------------------------------
def evaluate(data_path: str, prompts: int, prompt_len: int, new_tokens: int, num_steps: int) -> dict:
    """Mean accept length per algorithm with `num_steps` drafts, greedy, on held-out files."""
    from workers.engine import Engine, SamplingParams

    held = np.load(data_path)["held_out"].astype(np.int64)
    stride = (len(held) - prompt_len) // prompts
    batch = [held[i * stride : i * stride + prompt_len].tolist() for i in range(prompts)]
    target = os.path.join(MODELS_DIR, TARGET)
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    result = {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens, "num_steps": num_steps}
    start = time.perf_counter()
    ref = Engine(model=target, max_total_tokens=32768).generate(prompt_token_ids=batch, sampling=sp)
    result["no_speculation_s"] = round(time.perf_counter() - start, 2)
    for algorithm, name in DRAFTS.items():
        eng = Engine(
            model=target,
            max_total_tokens=32768,
            speculative={"algorithm": algorithm, "draft_model": os.path.join(MODELS_DIR, name), "num_steps": num_steps},
        )
        start = time.perf_counter()
        outs = eng.generate(prompt_token_ids=batch, sampling=sp)
        lengths = [n for o in outs for n in o.spec.accept_lengths]
        result[algorithm] = {
            "mean_accept_length": round(sum(lengths) / len(lengths), 3),
            "verify_steps": len(lengths),
            "seconds": round(time.perf_counter() - start, 2),
            "same_tokens_as_no_speculation": [o.token_ids for o in outs] == [o.token_ids for o in ref],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--data", required=True)
    t = sub.add_parser("train")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--target-seconds", type=float, default=240)
    t.add_argument("--draft-seconds", type=float, default=60)
    t.add_argument("--head-seconds", type=float, default=60)
    i = sub.add_parser("install")
    i.add_argument("--out", required=True)
    e = sub.add_parser("evaluate")
    e.add_argument("--data", required=True)
    e.add_argument("--prompts", type=int, default=16)
    e.add_argument("--prompt-len", type=int, default=192)
    e.add_argument("--new-tokens", type=int, default=64)
    e.add_argument("--num-steps", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s: %(message)s")
    if args.command == "prepare":
        prepare(args.data)
    elif args.command == "train":
        train(
            args.data,
            args.out,
            args.device,
            {"target": args.target_seconds, "standalone": args.draft_seconds, "heads": args.head_seconds},
        )
    elif args.command == "install":
        install(args.out)
    else:
        print(json.dumps(evaluate(args.data, args.prompts, args.prompt_len, args.new_tokens, args.num_steps), indent=1))


if __name__ == "__main__":
    main()

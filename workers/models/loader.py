"""Build a model and fill its weights from safetensors (single file or sharded index) or with
random values of the configured shapes (`load_format="dummy"`, for benchmarks)."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from collections.abc import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from workers.distributed import SINGLE_RANK, TPGroup
from workers.models import fp8, mxfp4
from workers.models.config import ModelConfig
from workers.models.decoder import STACKED_PARAMS, CausalLM
from workers.models.gemma4 import Gemma4CausalLM
from workers.models.gpt_oss import GptOssCausalLM
from workers.models.layers import RMSNorm
from workers.models.moe import Experts

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
MODELS: dict[str, type[CausalLM]] = {  # by `ArchSpec.model`
    "decoder": CausalLM,
    "gemma4": Gemma4CausalLM,
    "gpt_oss": GptOssCausalLM,
}


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = _index_shards(index)
        files = [os.path.join(model_dir, s) for s in shards]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise ValueError(f"model: the safetensors index names missing shards {absent}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(
            f"model: no *.safetensors weights in {model_dir!r} (use load_format='dummy' for random weights)"
        )
    return files


def _index_shards(index: str) -> list[str]:
    """The shard files a safetensors index's `weight_map` names."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"model: {index} is not a safetensors index (a weight_map of tensor -> file): {exc!r}"
        ) from exc
    if not shards or not all(isinstance(s, str) and s for s in shards):
        raise ValueError(f"model: {index}: weight_map must map tensor names to shard file names")
    return shards


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        try:
            f = safe_open(path, framework="pt")
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"model: {path} is not a readable safetensors file: {exc}") from exc
        with f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def init_dummy_weights(model: nn.Module, seed: int, std: float) -> None:
    """Normal(0, std) matrices (a `weight`, or any parameter of two or more dimensions: stacked
    experts), zero biases, norms and scalars (`identity`) at their identity; drawn on the
    parameters' device (a GPU fills an 8B model in a moment). FP8 projections hold such values
    quantised as a checkpoint's are, with the scales that gives; MXFP4 experts random codes under
    a scale of about `std` (`mxfp4.fill_dummy`)."""
    gens: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.reset_parameters()
            continue
        quantized = getattr(module, fp8.SCALE, None) is not None
        for name, param in module.named_parameters(recurse=False):
            gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
            if param.dtype == torch.uint8:  # MXFP4 experts' blocks and scales: below
                continue
            if quantized and name in ("weight", fp8.SCALE):
                if name == "weight":
                    values = torch.randn(param.shape, generator=gen, device=param.device) * std
                    fp8.fill(param, module.weight_scale, module.layout.block, values)
            elif name != "weight" and param.dim() < 2:
                param.data.fill_(getattr(param, "identity", 0.0))
            else:
                param.data.copy_(torch.randn(param.shape, generator=gen, device=param.device) * std)
        if isinstance(module, Experts) and module.mxfp4:
            for packed in module.matrices():
                device = packed.blocks.device
                gen = gens.setdefault(device, torch.Generator(device=device).manual_seed(seed))
                mxfp4.fill_dummy(packed.blocks.data, packed.scales.data, gen, std)


def build_model(
    cfg: ModelConfig,
    model_dir: str | None,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup = SINGLE_RANK,
    seed: int = 0,
) -> CausalLM:

    def make() -> CausalLM:
        with fp8.building(cfg.fp8):
            model = MODELS[cfg.arch.model](cfg, tp)
        if cfg.fp8 is not None:
            check_unquantized(model, cfg.fp8.skip)
        return model

    return build_module(make, cfg.architecture, model_dir, load_format, dtype, device, seed, cfg.initializer_range)


def check_unquantized(model: nn.Module, skip: tuple[str, ...]) -> None:
    """A checkpoint may leave modules unquantised (`modules_to_not_convert`, `ignored_layers`)
    where slidespec keeps the model's dtype anyway (the LM head, embeddings, routers); one of the
    FP8 projections is refused, naming it."""
    for name, module in model.named_modules():
        if getattr(module, fp8.SCALE, None) is None:
            continue
        names = [name] + [name[: -len(fused)] + part for fused, part, _ in STACKED_PARAMS if name.endswith(fused)]
        for entry in skip:
            if any(n == entry or n.endswith("." + entry) or n.startswith(entry + ".") for n in names):
                raise ValueError(
                    f"config.json: quantization_config.modules_to_not_convert names {entry!r}, a projection slidespec "
                    "holds in FP8 with the others; allowed: modules it keeps in the model's dtype (lm_head, "
                    "embeddings, routers)"
                )


def build_module(
    make: Callable[[], nn.Module],
    what: str,
    model_dir: str | None,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    init_std: float,
) -> nn.Module:
    """Create a model (target or draft head) in `dtype` on `device` and fill its weights from
    the directory's safetensors, or randomly (`load_format="dummy"`)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: unknown {load_format!r}; choose from {LOAD_FORMATS}")
    files = safetensors_files(model_dir) if load_format != "dummy" else []
    with torch.device(device), _default_dtype(dtype):
        model = make()
    if load_format == "dummy":
        init_dummy_weights(model, seed, init_std)
    else:
        model.load_weights(iter_safetensors(files))
        logger.info("loaded %s from %d safetensors file(s)", what, len(files))
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in the serving dtype (RoPE tables stay float32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

"""gpt-oss: a pre-norm decoder (Llama's layer) whose every MLP is a mixture of experts.

What differs from Llama, and where it lives:
- Attention has biases on q/k/v and o (`attention_bias`) and a learned sink logit per head that
  takes part in each query's softmax without a value (`SelfAttention.sinks`, read by every
  attention backend and kernel from the `AttentionLayer`).
- Sliding-window layers (128 keys) alternate with full ones (`layer_types`); RoPE is YaRN, read
  from the config as transformers computes it (`workers/models/config.py`).
- The MLP is `SparseMoE` (`workers/models/moe.py`): a biased router, top-k then softmax, and
  experts with biases and a clamped SwiGLU, stored in the checkpoint as `[E, in, out]` with gate
  and up columns alternating.
- Checkpoints ship the experts in MXFP4 (`workers/models/mxfp4.py`): kept in 4 bits for the MoE
  kernels, or dequantised as they load where a rank's share does not split into whole groups.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from workers.distributed import TPGroup
from workers.models.config import ModelConfig
from workers.models.decoder import CausalLM, DecoderLayer, DecoderModel, load_weights
from workers.models.moe import SparseMoE
from workers.models.mxfp4 import SUFFIXES, dequantized

logger = logging.getLogger(__name__)

# Checkpoint names of the router's projection -> its parameter's.
RENAMES = ((".mlp.router.weight", ".mlp.router.proj.weight"), (".mlp.router.bias", ".mlp.router.proj.bias"))


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup, reads_kv_only: bool = False) -> None:
        mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.rms_norm_eps, tp)
        super().__init__(cfg, layer_id, tp, reads_kv_only=reads_kv_only, mlp=mlp)


class GptOssModel(DecoderModel):
    layer_class = GptOssDecoderLayer


class GptOssCausalLM(CausalLM):
    model_class = GptOssModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's tensors; MXFP4 experts the model does not hold in MXFP4 dequantised
        to the serving dtype."""
        if self.cfg.quantization == "mxfp4":
            kept = {name for name, _ in self.named_parameters() if name.endswith(SUFFIXES)}
            if not kept:
                logger.info(
                    "MXFP4 experts dequantised to %s as they load: a rank's share of their %d intermediate columns "
                    "is not whole 32-value groups",
                    self.lm_head.weight.dtype,
                    self.cfg.moe.intermediate_size,
                )
            weights = dequantized(weights, self.lm_head.weight.dtype, kept)
        skip = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        load_weights(self, _renamed(weights), self.cfg.architecture, skip=skip)


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for old, new in RENAMES:
            if name.endswith(old):
                name = name[: -len(old)] + new
        yield name, tensor

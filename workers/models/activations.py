"""The MLPs' activations by their `config.json` names, as transformers defines them (its own
table imports transformers' model-loading and distributed-tensor machinery: seconds in every
process that only runs a forward)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation, written out as transformers' `NewGELUActivation` computes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "relu": F.relu,
}


def check_activation(name: str, field: str) -> str:
    """`name` if it is one of ACTIVATIONS; else ValueError naming the config field."""
    if name not in ACTIVATIONS:
        raise ValueError(f"config.json: {field} {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return name

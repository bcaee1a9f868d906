"""Hot-token draft vocabularies: the draft proposes only from a fixed list of target tokens.

A draft that scores the target's whole vocabulary (EAGLE-1 and frozen-KV MTP heads read the
target's LM head; standalone drafts have their own) spends most of a draft step's time there
on a large vocabulary. With `speculative.token_map` (SGLang's `--speculative-token-map`) its LM
head keeps the rows of the listed tokens only, and its argmax or distribution over them maps back
to target ids (`draft_to_target`, as an EAGLE-3 draft vocabulary does). Lossless: the target
verifies every draft; rejection sampling sees a draft distribution that is zero off the list.
A list is made from token frequencies on text like the traffic: `python -m ops.token_map`.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from torch import nn

from workers.distributed import TPGroup
from workers.models.ops import ops_for


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The token ids listed in `path` (a JSON list, a `.npy` array or a `torch.save`d 1-D
    tensor), checked: distinct and inside the target's vocabulary."""
    if not os.path.isfile(path):
        raise ValueError(f"speculative.token_map: {path!r} is not a file")
    if path.endswith(".json"):
        ids = np.asarray(json.load(open(path)))
    elif path.endswith(".npy"):
        ids = np.load(path)
    else:
        ids = torch.load(path, map_location="cpu", weights_only=True).numpy()
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"speculative.token_map: {path!r} must hold a non-empty 1-D list of token ids")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(
            f"speculative.token_map: ids must lie in [0, {vocab_size}) (the target's vocabulary), "
            f"got [{ids.min()}, {ids.max()}]"
        )
    if np.unique(ids).size != ids.size:
        raise ValueError(f"speculative.token_map: {path!r} lists some token ids twice")
    return torch.from_numpy(ids.astype(np.int64))


class HotTokenHead(nn.Module):
    """The LM-head rows of a list of tokens, whole on every rank (a full head is split over the
    vocabulary across ranks; these rows are gathered once, at start-up)."""

    def __init__(self, head: nn.Module, ids: torch.Tensor, tp: TPGroup) -> None:
        super().__init__()
        weight = head.weight if tp.size == 1 else tp.all_gather(head.weight, dim=0)
        self.register_buffer("weight", weight[: head.vocab_size][ids.to(weight.device)].clone(), persistent=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops_for(hidden).linear(hidden, self.weight, None)


def apply_token_map(draft: nn.Module, target: nn.Module, ids: torch.Tensor, tp: TPGroup) -> None:
    """Give `draft` the hot rows of the LM head it scores with (its own, else the target's) and
    the map from its logits' columns back to target ids."""
    if getattr(draft, "draft_to_target", None) is not None:
        raise ValueError("speculative.token_map: this draft already has a draft vocabulary of its own (d2t)")
    head = getattr(draft, "lm_head", None) or target.lm_head
    draft.lm_head = HotTokenHead(head, ids, tp)
    draft.draft_to_target = ids.to(draft.lm_head.weight.device)

"""Log-probabilities as requests return them: plain lists, small on the wire.

A generated token's logprob is read from the distribution its position was sampled from, the
target's after the processor stage (`workers/sampler.py`, `distribution_logits`): under
speculative decoding, from the target's verify rows at the accepted positions, never the
draft's. A prompt token's is the model's own (no processor acts on tokens nobody sampled).
docs/design.md §12 says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass
class Logprobs:
    """Consecutive tokens' log-probabilities: each token's own and its rank in its distribution
    (1: the most likely; vLLM's prompt logprobs show it), and the k most likely tokens of its
    position (ids and logprobs, most likely first; k as the request asked, fewer where the
    vocabulary is smaller). A logprob is -inf where the processors or top-k/top-p/min_p ruled
    the token out (JSON has no infinity: the doors render it)."""

    token: list[float] = dataclasses.field(default_factory=list)
    top_ids: list[list[int]] = dataclasses.field(default_factory=list)
    top: list[list[float]] = dataclasses.field(default_factory=list)
    rank: list[int] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token)

    def extend(self, other: Logprobs) -> None:
        self.token += other.token
        self.top_ids += other.top_ids
        self.top += other.top
        self.rank += other.rank

    def part(self, start: int, end: int) -> Logprobs:
        """The entries of tokens [start, end)."""
        return Logprobs(self.token[start:end], self.top_ids[start:end], self.top[start:end], self.rank[start:end])

    def tail(self, n: int) -> Logprobs:
        """The last n tokens' entries."""
        return self.part(len(self) - n, len(self))

    def copy(self) -> Logprobs:
        return self.part(0, len(self))


def of_rows(logits: torch.Tensor, tokens: torch.Tensor | Sequence[int], ks: Sequence[int]) -> Logprobs:
    """Row i's token `tokens[i]` and its `ks[i]` most likely tokens, from the distribution whose
    logits are row i of `logits` `[n, V]` (log_softmax), read to the host in one copy."""
    n, vocab = logits.shape
    if n == 0:
        return Logprobs()
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.tensor(list(tokens), dtype=torch.int64)
    own = logprobs.gather(1, tokens.to(logprobs.device, torch.int64).view(n, 1))
    rank = (logprobs > own).sum(dim=1, keepdim=True) + 1
    k = min(max(ks), vocab)
    top, ids = logprobs.topk(k, dim=-1) if k else (own[:, :0], own[:, :0])
    # one read: float64 holds every float32 and every token id exactly
    rows = torch.cat([own.double(), rank.double(), top.double(), ids.double()], dim=1).tolist()
    out = Logprobs()
    for row, want in zip(rows, ks):
        want = min(want, vocab)
        out.token.append(row[0])
        out.rank.append(int(row[1]))
        out.top.append(row[2 : 2 + want])
        out.top_ids.append([int(t) for t in row[2 + k : 2 + k + want]])
    return out

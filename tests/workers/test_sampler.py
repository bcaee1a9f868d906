"""The sampler against transformers' logits processors and against its own distribution."""

import pytest
import torch
from scipy.stats import chisquare
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from workers.sampler import sample, sampling_probs
from workers.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8), (0.5, 20, 0.6), (1.0, 1, 1.0)]
)
def test_probs_match_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * 3
    ours = sampling_probs(logits, params)
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    torch.testing.assert_close(ours, torch.softmax(ref, dim=-1), atol=1e-6, rtol=1e-5)


def test_rows_use_their_own_parameters():
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    mixed = sampling_probs(logits, [SamplingParams(top_k=3), SamplingParams(top_p=0.5, temperature=0.8)])
    torch.testing.assert_close(mixed[0], sampling_probs(logits[:1], [SamplingParams(top_k=3)])[0])
    torch.testing.assert_close(mixed[1], sampling_probs(logits[1:], [SamplingParams(top_p=0.5, temperature=0.8)])[0])
    assert (mixed[0] > 0).sum() == 3


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    sp = SamplingParams(temperature=0.9, top_p=0.95)
    probs = sampling_probs(logits, [sp])[0]
    gen = torch.Generator().manual_seed(0)
    draws = [sample(logits.clone(), [sp], [gen])[0] for _ in range(4000)]
    counts = torch.bincount(torch.tensor(draws), minlength=6).float()
    keep = probs > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep].numpy(), (probs[keep] * len(draws)).numpy()).pvalue > 0.01


def test_greedy_rows_take_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=2),
    ]
    tokens = sample(logits.clone(), params, gens)
    assert tokens[0] == logits[0].argmax().item() and tokens[2] == logits[2].argmax().item()

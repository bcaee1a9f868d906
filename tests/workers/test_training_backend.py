"""The training attention backend computes what serving computes: a target forward over whole
sequences gives the engine's prefill logits, and EAGLE and frozen-KV heads trained through it
see exactly the inputs and attention they get when drafting (their first draft state after a
prefill matches the engine's), so heads trained by ops/train_tiny_models serve as trained."""

import pytest
import torch

from attention.training import TrainingBackend
from ops.train_tiny_models import training_batch
from tests.draft_models import make_eagle_head, make_frozen_kv_head
from tests.hf_models import make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_backend")
    target = str(root / "gemma3")
    make_tiny_model("gemma3", target)
    return {
        "target": target,
        "eagle": make_eagle_head(target, str(root / "eagle"), 1),
        "frozen_kv_mtp": make_frozen_kv_head(target, str(root / "mtp")),
    }


def _target_pass(eng, tokens):
    backend = TrainingBackend(CPU)
    with torch.no_grad():
        hidden, _ = eng.runner.model(training_batch(tokens[None], backend))
        return backend, hidden, eng.runner.model.compute_logits(hidden)


def test_target_forward_matches_engine_prefill(dirs):
    prompt = random_prompts([40])[0]
    eng = Engine(model=dirs["target"], page_size=4, chunked_prefill_size=None, max_total_tokens=1024)
    eng.add_request(prompt, SamplingParams(max_new_tokens=1, temperature=0.0, return_logits=True))
    eng.step()
    (engine_logits,) = eng.output("req-0").logits
    _, _, logits = _target_pass(eng, torch.tensor(prompt))
    torch.testing.assert_close(logits[-1], engine_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("algorithm", ["eagle", "frozen_kv_mtp"])
def test_head_training_forward_matches_drafting(dirs, algorithm):
    prompt = random_prompts([40], seed=3)[0]
    eng = Engine(
        model=dirs["target"],
        page_size=4,
        chunked_prefill_size=None,
        max_total_tokens=1024,
        speculative={"algorithm": algorithm, "draft_model": dirs[algorithm], "num_steps": 2},
    )
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=0.0))
    eng.step()  # prefill, then the draft's catch-up proposes the first draft of the next round
    req = eng._requests[rid]
    tokens = torch.tensor(prompt + req.output_ids)  # x_0 .. x_L (x_L sampled by the prefill)
    head = eng.spec.drafter.runner.model
    with torch.no_grad():
        if algorithm == "eagle":  # entry i: token i + 1 and the target's hidden state at i
            backend, hidden, _ = _target_pass(eng, tokens[:-1])
            batch = training_batch(tokens[1:][None], backend, spec_hidden=hidden)
        else:  # row p: token p and the target's hidden state at p - 1, reading the target's KV below p
            backend, hidden, _ = _target_pass(eng, tokens)
            previous = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])
            batch = training_batch(tokens[None], backend, query_offset=1, spec_hidden=previous)
        out, handed_on = head(batch)
    torch.testing.assert_close(handed_on[-1], req.spec.next_hidden, atol=1e-4, rtol=1e-4)
    assert int(head.compute_logits(out[-1:]).argmax()) == req.spec.next_token

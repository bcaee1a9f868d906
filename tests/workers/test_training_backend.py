"""The training attention backend computes what serving computes: a target forward over whole
sequences gives the engine's prefill logits, and EAGLE and frozen-KV heads trained through it
see exactly the inputs and attention they get when drafting (their first draft state after a
prefill matches the engine's), so heads trained by ops/train_tiny_models serve as trained. The
same for Gemma 4 (two head sizes, KV-shared layers reading earlier layers' KV, per-layer inputs)
and its assistant, whose whole chain of drafts over the target's KV trains as a round drafts."""

import pytest
import torch

from attention.training import TrainingBackend
from ops.train_tiny_models import assistant_steps, target_pass, training_batch
from tests.draft_models import make_eagle_head, make_frozen_kv_head, make_gemma4_assistant
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


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_backend_gemma4")
    target = str(root / "target")
    make_tiny_model("gemma4", target)
    return {"target": target, "assistant": make_gemma4_assistant(target, str(root / "assistant"), seed=1)}


def test_gemma4_target_forward_matches_engine_prefill(gemma4):
    prompt = random_prompts([40], seed=4)[0]
    eng = Engine(model=gemma4["target"], page_size=4, chunked_prefill_size=None, max_total_tokens=1024)
    eng.add_request(prompt, SamplingParams(max_new_tokens=1, temperature=0.0, return_logits=True))
    eng.step()
    (engine_logits,) = eng.output("req-0").logits
    _, _, logits = _target_pass(eng, torch.tensor(prompt))
    torch.testing.assert_close(logits[-1], engine_logits, atol=1e-4, rtol=1e-4)


def test_gemma4_assistant_training_chain_matches_a_round_of_drafts(gemma4):
    """After a prefill of x_0..x_{L-1} and the sampled x_L, the engine drafts K tokens at
    position L over the target's KV; `assistant_steps` over x_0..x_L and those drafts gives each
    draft's state and token at row L."""
    k, prompt = 3, random_prompts([40], seed=5)[0]
    eng = Engine(
        model=gemma4["target"],
        page_size=4,
        chunked_prefill_size=None,
        max_total_tokens=1024,
        speculative={"algorithm": "mtp", "draft_model": gemma4["assistant"], "num_steps": k},
    )
    runner, seen = eng.spec.drafter.runner, []
    forward = runner.forward
    runner.forward = lambda batch, pool=None: seen.append(forward(batch, pool)) or seen[-1]
    rid = eng.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=0.0))
    eng.step()  # prefill; the catch-up drafts the first token of the next round
    eng.step()  # the round: drafts 2..k, then the verify
    assistant = runner.model
    drafts = [int(out.ids[0, out.logits[0].argmax()]) for out in seen[:k]]
    tokens = torch.tensor(prompt + eng._requests[rid].output_ids[:1] + drafts[:-1])
    backend = TrainingBackend(CPU)
    with torch.no_grad():
        hidden, _ = target_pass(eng.runner.model, backend, tokens[None, : len(prompt) + 1], "cpu")
        chain = assistant_steps(assistant, tokens[None], hidden, backend, k)
    for j, ((normed, state), out) in enumerate(zip(chain, seen[:k])):
        # float32 noise between the two attention paths (about 1e-5 at the first draft) grows
        # about fourfold with each draft step of this random assistant; a wrong position, token or
        # state is off by the states' own size (about 1)
        atol = 1e-4 * 4**j
        torch.testing.assert_close(state[-1], out.hidden[0], atol=atol, rtol=1e-4, msg=f"draft {j + 1}")
        logits, ids = assistant.subset_logits(normed[-1:])
        assert int(ids[0, logits[0].argmax()]) == drafts[j], f"draft {j + 1}"

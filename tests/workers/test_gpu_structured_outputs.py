"""Structured outputs on the GPU: the grammar mask filled on the host and applied on the device
(xgrammar's Triton kernel), bf16, CUDA graphs on, with each of the shipped tiny model's drafts.
Every output that finishes matches its grammar (independent references, as the CPU test's), and
the logits agree with decoding without speculation within bf16 noise up to any first divergence
(the criterion of the engine's GPU test)."""

import pytest
import torch

from ops.bench.structured_overhead import SCHEMA as BENCH_SCHEMA
from tests.workers.test_gpu_engine import compare_bf16_runs
from tests.workers.test_structured_outputs import DRAFTS, SPECS, TARGET, TEXTS, _matches
from workers.engine import Engine, SamplingParams
from workers.grammar import StructuredOutputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("algorithm", sorted(DRAFTS))
def test_structured_outputs_under_speculation_on_gpu(algorithm):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    common = dict(device="cuda", dtype="bfloat16", page_size=16, attention_backend="trtllm_mha", context_length=512)
    plain = Engine(model=TARGET, **common)
    prompts = [plain.tokenizer.encode(t) for t in TEXTS]
    params = [
        SamplingParams(max_new_tokens=40, temperature=0.0, return_logits=True, structured_outputs=spec)
        for spec in SPECS
        for _ in prompts
    ]
    batch = prompts * len(SPECS)
    ref = plain.generate(prompt_token_ids=batch, sampling=params)
    spec = {"algorithm": algorithm, "draft_model": DRAFTS[algorithm], "num_steps": 3}
    eng = Engine(model=TARGET, speculative=spec, **common)
    outs = eng.generate(prompt_token_ids=batch, sampling=params)
    eng.check_no_leak()
    for out, sp in zip(ref + outs, params + params):
        if out.finish_reason == "stop":
            assert _matches(sp.structured_outputs, out.text), (sp.structured_outputs.kind, out.text)
    diverged, worst = compare_bf16_runs(ref, outs, algorithm)
    print(f"{algorithm}: {diverged} of {len(outs)} requests diverged (largest logit difference {worst:.3g})")
    assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) // 2


def test_overlapped_greedy_decoding_under_grammars_on_gpu():
    """The overlap schedule with a grammar (masks filled while the next forward runs, applied to
    the greedy decode graph's logits before the argmax) gives step-by-step decoding's tokens. The
    benchmark's schema cannot end within these lengths, so both runs replay the same graphs on
    the same batches (a request ending on a stop token would ride one overlapped step more)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    common = dict(device="cuda", dtype="bfloat16", page_size=16, attention_backend="trtllm_mha", context_length=512)
    grammar = StructuredOutputs(json=BENCH_SCHEMA)
    params = [SamplingParams(max_new_tokens=9 + 6 * i, temperature=0.0, structured_outputs=grammar) for i in range(8)]
    runs = []
    for overlap in (False, True):
        eng = Engine(model=TARGET, overlap_schedule=overlap, **common)
        prompts = [eng.tokenizer.encode(TEXTS[i % len(TEXTS)]) for i in range(len(params))]
        runs.append(eng.generate(prompt_token_ids=prompts, sampling=params))
        eng.check_no_leak()
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]
    assert all(o.finish_reason == "length" for o in runs[1])

"""ops/train_tiny_models cannot rot: the Gemma 4 pair's whole path (target through transformers,
the assistant distilled through our model code, checkpoints, evaluation, install) runs a step
on the CPU; the shipped configs and tokenizer are what the script writes; the assistant's
checkpoint keeps the centroid head as trained; the token ordering groups similar LM-head rows."""

import json
import os

import numpy as np
import pytest
import torch
import transformers

from ops import MODELS_DIR
from ops import train_tiny_models as T
from workers.engine import Engine

K = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The Gemma 4 pair trained one step on a corpus of random ids, and the corpus."""
    root = tmp_path_factory.mktemp("train_tiny")
    ids = np.random.default_rng(0).integers(2, T.VOCAB, 3000).astype(np.uint16)
    data = str(root / "corpus.npz")
    np.savez(data, train=ids, held_out=ids[:400])
    out = str(root / "out")
    budget = {"target": 60.0, "standalone": 60.0, "heads": 60.0}
    figures = T.train(data, out, "cpu", budget, ["gemma4"], steps=1, batch=1, seq=24)
    return data, out, figures


def test_gemma4_pair_trains_evaluates_and_installs(trained, tmp_path):
    data, out, figures = trained
    assert {name: f["steps"] for name, f in figures.items()} == {T.GEMMA4_TARGET: 1, T.ASSISTANT: 1}
    assert json.load(open(os.path.join(out, "summary.json"))) == figures
    for name, model_class in ((T.GEMMA4_TARGET, "AutoModelForCausalLM"), (T.ASSISTANT, "Gemma4AssistantForCausalLM")):
        _, info = getattr(transformers, model_class).from_pretrained(os.path.join(out, name), output_loading_info=True)
        assert not any(info.values()), f"{name}: transformers reads the checkpoint otherwise: {info}"
    result = T.evaluate(data, ["gemma4"], prompts=1, prompt_len=12, new_tokens=6, num_steps=K, models_dir=out)
    mtp = result[f"{T.GEMMA4_TARGET}/mtp"]
    assert mtp["lossless"] and 1 <= mtp["accept_length"] <= K + 1 and mtp["verify_steps"] > 0
    models = tmp_path / "models"
    for name in (T.GEMMA4_TARGET, T.ASSISTANT):
        T.write_config(str(models), name, T.SETS["gemma4"].configs[name])
    T.install(out, ["gemma4"], models_dir=str(models))
    assert (models / T.ASSISTANT / "model.safetensors").read_bytes() == open(
        os.path.join(out, T.ASSISTANT, "model.safetensors"), "rb"
    ).read()


def test_assistant_checkpoint_keeps_the_centroid_head_as_trained(trained, tmp_path):
    """Saved with the LM head in token order and the ordering beside it, the assistant loads
    with each centroid's rows where training had them."""
    from safetensors.torch import save_file

    _, out, _ = trained
    assistant, _ = T.train_assistant(
        os.path.join(out, T.GEMMA4_TARGET), os.path.join(out, T.ASSISTANT), None, 0, 0.0, 0.0, "cpu"
    )
    path = T.write_config(str(tmp_path), "assistant", T.ASSISTANT_CONFIG)
    save_file(T.assistant_tensors(assistant), os.path.join(path, "model.safetensors"))
    eng = Engine(
        model=os.path.join(out, T.GEMMA4_TARGET),
        max_total_tokens=256,
        speculative={"algorithm": "mtp", "draft_model": path, "num_steps": K},
    )
    loaded, trained_head = eng.spec.drafter.runner.model.masked_embedding, assistant.masked_embedding
    assert torch.equal(loaded.token_ordering, trained_head.token_ordering)
    assert torch.equal(loaded.weight, trained_head.weight.to(torch.bfloat16).float())
    assert torch.equal(loaded.centroids.weight, trained_head.centroids.weight.to(torch.bfloat16).float())


def test_balanced_clusters_put_similar_rows_together():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=g) * 10
    rows = centres.repeat_interleave(16, dim=0) + torch.randn(64, 16, generator=g)
    order = T.balanced_clusters(rows, 4)
    assert sorted(order.tolist()) == list(range(64))
    clusters = order.view(4, 16) // 16  # each block's rows' cluster
    assert (clusters == clusters[:, :1]).all() and sorted(clusters[:, 0].tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="num_centroids 3"):
        T.balanced_clusters(rows, 3)


def test_shipped_gemma4_pair_is_what_the_script_writes():
    """Configs and tokenizer as `prepare` writes them (the tokenizer shared with the Gemma 3
    set), and at most 8 MiB of weights together."""
    for name, config in T.SETS["gemma4"].configs.items():
        assert json.load(open(os.path.join(MODELS_DIR, name, "config.json"))) == config
    for file in T.TOKENIZER_FILES:
        shipped = open(os.path.join(MODELS_DIR, T.GEMMA4_TARGET, file), "rb").read()
        assert shipped == open(os.path.join(MODELS_DIR, T.TARGET, file), "rb").read()
    sizes = [os.path.getsize(os.path.join(MODELS_DIR, n, "model.safetensors")) for n in T.SETS["gemma4"].directories]
    assert sum(sizes) <= 8 * 2**20

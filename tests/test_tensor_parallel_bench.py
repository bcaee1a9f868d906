"""The tensor-parallel benchmark's settings and report shape (its runs need two GPUs)."""

import pytest

from ops.bench.tensor_parallel import cases, run_name, spec_settings


def test_speculative_drafts_are_the_shapes_dummy_drafts(tmp_path):
    got = spec_settings(str(tmp_path), "llama3-8b", "eagle3,frozen_kv_mtp,eagle3-replicated")
    assert list(got) == ["eagle3", "frozen_kv_mtp", "eagle3-replicated"]
    assert got["eagle3"]["algorithm"] == "eagle" and got["eagle3"]["adaptive"] is False
    assert got["eagle3"]["draft_tp"] == "shard" and got["eagle3-replicated"]["draft_tp"] == "replicate"
    assert got["eagle3-replicated"]["draft_model"] == got["eagle3"]["draft_model"]
    assert spec_settings(str(tmp_path), "gemma3-12b", "") == {}
    assert list(spec_settings(str(tmp_path), "gpt-oss-20b", "eagle3")) == ["eagle3"]
    with pytest.raises(SystemExit, match="medusa unknown for llama3-8b; choose from eagle, eagle3"):
        spec_settings(str(tmp_path), "llama3-8b", "eagle,medusa")
    with pytest.raises(SystemExit, match="gemma3-12b has no drafts"):
        spec_settings(str(tmp_path), "gemma3-12b", "eagle3")


def test_cases_name_each_shape_run_and_batch():
    assert run_name(2, "one_shot", "tensor") == "tp2/one_shot"
    assert run_name(2, "nccl", "expert", "eagle3") == "tp2/nccl/moe_expert/spec_eagle3"
    report = {
        "shape": "gpt-oss-20b",
        "tp1/nccl": {"b1": {"tok_per_s": 200.0, "speedup_over_tp1": 1.0}},
        "tp2/one_shot": {
            "b1": {"tok_per_s": 300.0, "speedup_over_tp1": 1.5, "profile": {"top_kernels": []}},
            "allreduce_us/b1": 5.0,
        },
        "tp2/one_shot/moe_expert": {"b1": {"tok_per_s": 250.0, "speedup_over_tp1": 1.25}},
    }
    assert cases(report) == {
        "gpt-oss-20b/tp1/nccl/b1": {"tok_per_s": 200.0, "speedup_over_tp1": 1.0},
        "gpt-oss-20b/tp2/one_shot/b1": {"tok_per_s": 300.0, "speedup_over_tp1": 1.5, "allreduce_us": 5.0},
        "gpt-oss-20b/tp2/one_shot/moe_expert/b1": {"tok_per_s": 250.0, "speedup_over_tp1": 1.25},
    }


def test_a_run_timing_drafts_keeps_its_plain_steps_inside_the_rounds():
    """Without one GPU in the run, its plain steps have no speed-up: recording them as plain
    cases would replace those of a full run."""
    report = {
        "shape": "llama3-8b",
        "tp2/one_shot": {"b1": {"tok_per_s": 300.0}, "allreduce_us/b1": 5.0, "allreduce_norm_us/b1": 6.0},
        "tp2/one_shot/spec_eagle3": {
            "b1": {"tok_per_s": 250.0, "plain_ms_per_step": 2.5, "round_over_plain_step": 1.2},
            "allreduce_us/b1": 5.0,
        },
    }
    assert cases(report) == {
        "llama3-8b/tp2/one_shot/spec_eagle3/b1": {
            "tok_per_s": 250.0,
            "plain_ms_per_step": 2.5,
            "round_over_plain_step": 1.2,
            "allreduce_us": 5.0,
        },
    }

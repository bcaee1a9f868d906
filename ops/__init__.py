"""Operations: deploy configs, diagnosis tools, benchmarks and shipped tiny models."""

import os

MODELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")  # cluster.config finds it too

DEFAULT_MODEL = os.path.join(MODELS_DIR, "tiny-gemma3")
DRAFT_MODELS = {
    "standalone": os.path.join(MODELS_DIR, "tiny-gemma3-draft"),
    "eagle": os.path.join(MODELS_DIR, "tiny-gemma3-eagle"),
    "frozen_kv_mtp": os.path.join(MODELS_DIR, "tiny-gemma3-mtp"),
}
# The shipped tiny sets (ops/train_tiny_models.py): a target and its drafts by speculative algorithm.
TINY_SETS = {
    "gemma4": (os.path.join(MODELS_DIR, "tiny-gemma4"), {"mtp": os.path.join(MODELS_DIR, "tiny-gemma4-assistant")}),
    "gemma3": (DEFAULT_MODEL, DRAFT_MODELS),
}

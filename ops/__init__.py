"""Operations: deploy configs, diagnosis tools, benchmarks and shipped tiny models."""

import os

from cluster.config import SHIPPED_MODELS_DIR as MODELS_DIR

DEFAULT_MODEL = os.path.join(MODELS_DIR, "tiny-gemma3")
DRAFT_MODELS = {
    "standalone": os.path.join(MODELS_DIR, "tiny-gemma3-draft"),
    "eagle": os.path.join(MODELS_DIR, "tiny-gemma3-eagle"),
    "frozen_kv_mtp": os.path.join(MODELS_DIR, "tiny-gemma3-mtp"),
}

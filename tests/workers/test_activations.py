"""The MLP activations equal transformers' by name (float32), and a config naming one that is not
supported is refused naming its field."""

import json

import pytest
import torch
from transformers.activations import ACT2FN

from ops import DEFAULT_MODEL
from workers.models import load_model_config
from workers.models.activations import ACTIVATIONS


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_each_activation_is_transformers(name):
    x = torch.linspace(-8, 8, 4097, dtype=torch.float32)
    torch.testing.assert_close(ACTIVATIONS[name](x), ACT2FN[name](x), rtol=0, atol=1e-6)


def test_an_unsupported_activation_is_refused_naming_its_field(tmp_path):
    config = json.load(open(f"{DEFAULT_MODEL}/config.json"))
    field = "hidden_activation" if "hidden_activation" in config else "hidden_act"
    config[field] = "mish"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{field} 'mish' is not supported"):
        load_model_config(str(tmp_path))

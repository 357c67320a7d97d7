"""The weight-size check that refuses a model one GPU cannot hold, before anything is allocated."""
from __future__ import annotations

import pytest

from engine.model_size import check_fits, param_count
from tiny_models import make_config


@pytest.mark.parametrize("arch,kw", [("qwen3", {}), ("qwen3", dict(tie_word_embeddings=True)),
                                     ("qwen2", {}), ("qwen3_moe", {}), ("qwen2_moe", {})])
def test_param_count_equals_hf(arch, kw):
    import torch
    from transformers import AutoModelForCausalLM
    cfg = make_config(arch, **kw)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    assert param_count(cfg) == hf.num_parameters()


def _qwen25_72b():
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])


def test_72b_on_one_h200_is_refused_with_the_memory_and_the_tp_that_fits():
    cfg = _qwen25_72b()
    assert 72.5e9 < param_count(cfg) < 72.9e9
    with pytest.raises(ValueError) as e:
        check_fits(cfg, 1, 2, 143_771 * 2**20, 0.9, "bfloat16")
    msg = str(e.value)
    assert "145." in msg and "GB" in msg and "--tp 2" in msg
    check_fits(cfg, 2, 2, 143_771 * 2**20, 0.9, "bfloat16")     # two of them do

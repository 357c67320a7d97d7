"""Tiny random Qwen checkpoints saved by HF transformers, with a small trained tokenizer.

Tests compare our engine against HF on these: same files, two implementations.
"""
from __future__ import annotations

import json
import os

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CORPUS = [
    "the quick brown fox jumps over the lazy dog", "paged attention reads keys through a block table",
    "continuous batching mixes prefill and decode", "hello world this is glassbox",
    "one two three four five six seven eight nine ten", "what is 12 + 34 ? it is 46",
] * 20


def build_tokenizer(out_dir: str, vocab_size: int = 200):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def make_config(arch: str, **kw):
    from transformers import Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0)
    if arch == "qwen3":
        cls, extra = Qwen3Config, dict(head_dim=16, architectures=["Qwen3ForCausalLM"])
    elif arch == "qwen2":
        cls, extra = Qwen2Config, dict(architectures=["Qwen2ForCausalLM"])
    elif arch == "qwen3_moe":
        cls, extra = Qwen3MoeConfig, dict(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, norm_topk_prob=True,
                                          decoder_sparse_step=1, mlp_only_layers=[],
                                          architectures=["Qwen3MoeForCausalLM"])
    elif arch == "qwen2_moe":
        cls, extra = Qwen2MoeConfig, dict(num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48,
                                          norm_topk_prob=False, decoder_sparse_step=1,
                                          mlp_only_layers=[1],
                                          architectures=["Qwen2MoeForCausalLM"])
    else:
        raise ValueError(arch)
    base.update(extra)
    base.update(kw)
    return cls(**base)


def build_model_dir(out_dir: str, arch: str = "qwen3", seed: int = 0, **kw) -> str:
    """Save a random HF model + tokenizer + generation_config into out_dir; return it."""
    from transformers import AutoModelForCausalLM
    os.makedirs(out_dir, exist_ok=True)
    cfg = make_config(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # HF inits some weights to exactly 0/1 (norms, biases); randomise so tests see them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    tok = build_tokenizer(out_dir)
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos, "bos_token_id": None}, f)
    return out_dir


def load_hf(path: str):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                             attn_implementation="eager")
    return m.eval()

"""Qwen2 / Qwen2.5 (q/k/v bias, no q/k norm) and Qwen3 (q/k RMSNorm, no bias), dense MLP.

One token's path: embed -> N x [RMSNorm -> QKV -> (q/k norm) -> RoPE -> paged attention ->
o_proj -> RMSNorm -> MLP] -> final norm -> LM head. Residual adds are fused into the norms;
the residual each fused norm returns is the true residual stream, which the probes read.
Every layer that launches a kernel is given the engine's KernelConfig (`kernels`).
"""
from __future__ import annotations

import torch
from torch import nn

from ..context import get_context
from ..kernel_config import DEFAULT_KERNELS, KernelConfig
from ..layers.activation import silu_and_mul
from ..layers.attention import Attention
from ..layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..layers.norm import RMSNorm
from ..layers.norm_linear import norm_linear
from ..layers.rotary import RotaryEmbedding, rope_theta


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def fused_qkv_path(qkv: torch.Tensor) -> bool:
    """The GPU runs q/k norm + RoPE + K/V store as one Triton launch; the CPU keeps the torch
    ops (the default experience: the same tokens as ever; Triton would only be interpreted)."""
    return qkv.is_cuda


class QwenAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary_emb: RotaryEmbedding,
                 kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        d = head_dim_of(config)
        qwen3 = "Qwen3" in config.architectures[0]
        bias = getattr(config, "attention_bias", False) if qwen3 else True
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, kernels=kernels)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size,
                                        bias=False, after_attention=True, kernels=kernels)
        self.qk_norm = qwen3
        if qwen3:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, kernels)
        self.rotary_emb = rotary_emb  # one table per model, shared by every layer
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, d, d ** -0.5, kernels)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Everything after the QKV projection (qkv [N, (Hq + 2 Hkv) D]): the decoder layer
        calls this with a projection it fused with the input norm."""
        n, d = qkv.shape[0], self.head_dim
        if fused_qkv_path(qkv):
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm \
                else (None, None, 0.0)
            o = self.attn.forward_qkv(qkv, positions, self.rotary_emb.cos_sin_cache, *norms)
        else:
            q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d,
                                 self.num_kv_heads * d], -1)
            q = q.reshape(n, self.num_heads, d)             # [N, Hq, D]
            k = k.reshape(n, self.num_kv_heads, d)          # [N, Hkv, D]
            v = v.reshape(n, self.num_kv_heads, d)
            if self.qk_norm:
                q = self.q_norm(q.reshape(-1, d)).view(n, self.num_heads, d)
                k = self.k_norm(k.reshape(-1, d)).view(n, self.num_kv_heads, d)
            q, k = self.rotary_emb(positions, q, k)
            o = self.attn(q, k, v)                          # [N, Hq, D]
        iv = get_context().interventions    # ablated heads' slice of the output zeroed
        if iv is not None:
            o = iv.ablate(self.attn.layer_idx, o)
        return self.o_proj(o.reshape(n, self.num_heads * d))


class QwenMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int,
                 kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       kernels=kernels)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.kernels.pdl))


class QwenDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary_emb: RotaryEmbedding, mlp: nn.Module,
                 kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = QwenAttention(config, layer_idx, rotary_emb, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = mlp

    def forward(self, positions, hidden, residual):
        # the residual entering layer i is hook_embed (i = 0) or blocks.{i-1}.hook_resid_post;
        # its norm kernel also stores sum(residual^2) for the probes (no extra launch)
        ctx = get_context()
        probes = ctx.probes
        sumsq = probes.sumsq_out(self.layer_idx) if probes is not None else None
        # the input norm is folded into the QKV projection at batch 1 on the GPU (norm_linear.py)
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, hidden,
                                    residual, sumsq)
        if probes is not None:
            probes.on_resid(self.layer_idx, residual)
        hidden = self.self_attn.attend(positions, qkv)
        if type(self.mlp) is QwenMLP:  # dense: the norm folds into gate_up as well
            act, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj,
                                        hidden, residual, gated=True)
            out = self.mlp.down_proj(act)
        elif hasattr(self.mlp, "forward_norm"):  # MoE: the norm may fold into the router
            out, residual = self.mlp.forward_norm(hidden, residual, self.post_attention_layernorm)
        else:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            out = self.mlp(hidden)
        iv = ctx.interventions              # steering: out + residual is hook_resid_post
        if iv is not None:
            out = iv.layer_out(self.layer_idx, out, residual)
        return out, residual


class QwenModel(nn.Module):
    def __init__(self, config, max_positions: int, make_mlp,
                 kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # one cos/sin table for all layers: [max_positions, D] fp32 (one per layer was
        # 28 x 20 MiB at Qwen3-0.6B shapes); modules() visits the shared module once
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), max_positions, rope_theta(config))
        self.layers = nn.ModuleList(
            QwenDecoderLayer(config, i, self.rotary_emb, make_mlp(config, i, kernels), kernels)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        probes = get_context().probes
        last = len(self.layers)
        hidden, residual = self.norm(hidden, residual,
                                     probes.sumsq_out(last) if probes is not None else None)
        if probes is not None:
            probes.on_resid(last, residual)
        return hidden


class QwenForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter, which piece)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def make_mlp(config, layer_idx: int, kernels: KernelConfig = DEFAULT_KERNELS) -> nn.Module:
        return QwenMLP(config.hidden_size, config.intermediate_size, kernels)

    def __init__(self, config, max_positions: int, kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        self.config = config
        self.kernels = kernels      # the engine's kernel choices, given to every layer
        self.model = QwenModel(config, max_positions, self.make_mlp, kernels)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, kernels)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids, positions)
        probes = get_context().probes
        if probes is not None:
            probes.on_final(self)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

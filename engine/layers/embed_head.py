"""Vocabulary-parallel embedding and LM head. The vocabulary is padded up to a multiple of
the TP size; each rank holds a contiguous slice, and padded rows are zero and never sampled."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernel_config import DEFAULT_KERNELS, KernelConfig
from ..parallel_state import get_tp
from .gemm import linear
from .linear import copy_checked, materialize, narrow, shape_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = get_tp()
        tp = self.tp.size
        self.vocab_size = vocab_size
        self.per_rank = (vocab_size + tp - 1) // tp
        self.start = self.tp.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shape_of(loaded)[0] != self.vocab_size:
            raise ValueError(f"embedding has {shape_of(loaded)[0]} rows, config vocab_size is "
                             f"{self.vocab_size}")
        n = self.end - self.start
        param.data.zero_()
        if n > 0:
            copy_checked(param.data[:n], materialize(narrow(loaded, 0, self.start, n)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local < 0) | (local >= self.per_rank)
        y = F.embedding(local.masked_fill(mask, 0), self.weight)
        y = y.masked_fill(mask[:, None], 0.0)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ W^T, gathered over ranks and cut back to the true vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__(vocab_size, hidden_size)
        self.kernels = kernels    # the engine's kernel choices (PDL)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, pdl=self.kernels.pdl)    # [n, vocab_per_rank]
        if self.tp.size > 1:
            logits = self.tp.all_gather_dim(logits, -1)[:, :self.vocab_size]
        return logits

"""The loaded model opened up, computed from the running engine, never typed in: vocabulary,
weights per part, the runtime code of each stage, one token's path with its shapes, the KV
cache's data plane and what each tensor-parallel rank holds. It reads the engine only through
its public API (`llm.model_parts()`, `llm.hf_config`, `llm.tokenizer`, the model facts).

    a = model_anatomy(llm)
    a.weights.total_params, a.path.attention, a.kv.regions(block_id=3), a.tp_plan(4)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .architecture import Architecture, architecture_of_config, architecture_of_model
from .kv_regions import KVDataPlane, KVRegion, kv_data_plane, read_kv_cache_bytes
from .published import PUBLISHED, SOURCE, ShapeRow, published_rows, shape_row
from .runtime_code import CodeRef, KernelRef, runtime_code
from .tensor_parallel import (GPU_UTILISATION, H200_BYTES, CollectivePoint, TPPlan,
                              collective_points, tp_plan)
from .token_path import PathStage, TokenPath, token_path
from .vocabulary import TokenPiece, Vocabulary, parse_ids, pieces_of_ids, tokenize, vocabulary
from .weights import WeightBreakdown, WeightPart, weight_breakdown

__all__ = [
    "Architecture", "CodeRef", "CollectivePoint", "KVDataPlane", "KVRegion", "KernelRef",
    "ModelAnatomy", "PUBLISHED", "PathStage", "SOURCE", "ShapeRow", "TPPlan", "TokenPath",
    "TokenPiece", "Vocabulary", "WeightBreakdown", "WeightPart", "GPU_UTILISATION", "H200_BYTES",
    "architecture_of_config", "architecture_of_model", "model_anatomy", "parse_ids",
    "pieces_of_ids", "published_rows", "read_kv_cache_bytes", "shape_row", "tokenize",
]


@dataclass
class ModelAnatomy:
    model_name: str
    dtype: str
    device: str
    tp_size: int
    block_size: int
    num_kv_blocks: int
    arch: Architecture
    vocabulary: Vocabulary
    weights: WeightBreakdown
    code: list[CodeRef]
    path: TokenPath
    kv: KVDataPlane
    collectives: list[CollectivePoint]
    rank0_params: int               # parameters rank 0 really holds (its tensors, counted)

    def code_for(self, key: str) -> CodeRef | None:
        return next((c for c in self.code if c.key == key), None)

    def tp_plan(self, tp: int | None = None, elem_bytes: int | None = None,
                gpu_bytes: int = H200_BYTES, utilisation: float = GPU_UTILISATION) -> TPPlan:
        """The split at degree tp (default: the running one) for this engine's KV cache size."""
        return tp_plan(self.arch, self.weights, tp or self.tp_size, elem_bytes=elem_bytes,
                       kv_tokens=self.num_kv_blocks * self.block_size,
                       collectives=self.collectives, gpu_bytes=gpu_bytes,
                       utilisation=utilisation)


def model_anatomy(llm) -> ModelAnatomy:
    model, kv_cache = llm.model_parts()
    arch = architecture_of_model(model, llm.hf_config, llm.model_name)
    dtype = str(llm.dtype).replace("torch.", "")
    elem = torch.empty(0, dtype=llm.dtype).element_size()
    kv = kv_data_plane(kv_cache)
    return ModelAnatomy(
        model_name=llm.model_name, dtype=dtype, device=str(llm.device), tp_size=llm.tp_size,
        block_size=kv.shape[3], num_kv_blocks=kv.num_blocks, arch=arch,
        vocabulary=vocabulary(llm.tokenizer, arch.vocab_size,
                              getattr(llm, "eos_token_ids", None) or ()),
        weights=weight_breakdown(arch, elem, dtype), code=runtime_code(model),
        path=token_path(arch), kv=kv, collectives=collective_points(model),
        rank0_params=sum(p.numel() for p in model.parameters()))

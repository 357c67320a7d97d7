"""Checkpoint -> parameters. Exact name mapping; every parameter (and every piece of a fused
parameter) loaded exactly once; every checkpoint tensor used or deliberately ignored.

Sharding lives in each parameter's `weight_loader`; this file only routes names to loaders.
"""
from __future__ import annotations

import json
import os
from glob import glob
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .errors import CheckpointMismatchError, ModelNotFoundError

# checkpoint tensors that carry no parameters of ours
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_model_path(model: str) -> str:
    """A local HF-format directory, or a hub id fetched through huggingface_hub."""
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFoundError(f"{p} has no config.json; pass a Hugging Face-format "
                                     "model directory (config.json + *.safetensors + tokenizer)")
        return str(p)
    if p.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelNotFoundError(f"model {model!r} is not a directory and not a hub id "
                                 "('org/name'); pass the path of a local checkpoint directory")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                        "tokenizer*", "*.model", "*.tiktoken"])
    except Exception as e:   # offline, unknown repo, gated ...
        raise ModelNotFoundError(
            f"could not fetch {model!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            "Offline, download the checkpoint elsewhere and pass its local directory with "
            "--model /path/to/checkpoint") from None


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.exists(os.path.join(path, s))]
        if missing:
            raise CheckpointMismatchError(f"{index} names shard files that are missing: {missing}")
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointMismatchError(f"no *.safetensors files in {path}; Glassbox loads "
                                      "safetensors checkpoints (convert .bin with transformers)")
    return files


def _route(model: nn.Module, name: str):
    """Checkpoint tensor name -> (our parameter name, shard key) or None if unknown."""
    custom = getattr(model, "map_checkpoint_name", None)
    if custom is not None:
        hit = custom(name)
        if hit is not None:
            return hit
    for frag, (fused, shard) in model.packed_modules_mapping.items():
        if f".{frag}." in name:
            return name.replace(f".{frag}.", f".{fused}."), shard
    return name, None


def load_weights(model: nn.Module, path: str) -> None:
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {n: set() for n in params}
    unexpected, duplicates = [], []
    tied = getattr(model, "tied", False)
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                pname, shard = _route(model, name)
                param = params.get(pname)
                if param is None:
                    unexpected.append(name)
                    continue
                if shard in loaded[pname]:
                    duplicates.append(name)
                    continue
                loader = getattr(param, "weight_loader", None)
                sl = f.get_slice(name)
                if loader is None:
                    param.data.copy_(sl[:])
                    filled = None
                else:
                    filled = loader(param, sl, shard) if shard is not None else loader(param, sl)
                # a loader that fills several pieces at once (fused experts) says which
                filled = set(filled) if filled is not None else {shard}
                if filled & loaded[pname]:
                    duplicates.append(name)
                loaded[pname] |= filled
    missing = []
    for n, p in params.items():
        expected = getattr(p, "shard_keys", None) or {None}
        lacking = set(expected) - loaded[n]
        if lacking:
            missing.append(n if lacking == set(expected) or expected == {None}
                           else f"{n} (pieces {sorted(map(str, lacking))})")
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {missing[:20]}"
                        + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected tensors (no parameter takes them): {unexpected[:20]}"
                        + (f" (+{len(unexpected) - 20} more)" if len(unexpected) > 20 else ""))
    if duplicates:
        problems.append(f"tensors given twice: {duplicates[:20]}")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match the model built from its config.json: "
            + "; ".join(problems) + ". Check that config.json belongs to these weights.")


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks (throughput does not depend on weight values)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            cpu = torch.empty(p.shape, dtype=torch.float32).uniform_(-0.04, 0.04, generator=g) \
                if p.numel() < (1 << 24) else None
            if cpu is not None:
                p.data.copy_(cpu)
            else:     # large tensors: draw on the device, chunk by chunk
                p.data.uniform_(-0.04, 0.04)

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

from .errors import CheckpointFormatError, CheckpointMismatchError, ModelNotFoundError

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


def _allowed_roots(path: str) -> list[Path]:
    """Where the checkpoint's files may really live: its directory, and for a huggingface_hub
    cache snapshot (snapshots/<rev>/ of symlinks) the repo's blobs/ beside it."""
    root = Path(path).resolve()
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return roots


def _inside(file: str, roots: list[Path]) -> bool:
    real = Path(file).resolve()
    return any(real == r or r in real.parents for r in roots)


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint: the shards its index names, else every
    *.safetensors file. Each must lie inside the checkpoint directory (an index entry such as
    "../x.safetensors", an absolute path, or a symlink out of the directory is refused)."""
    roots = _allowed_roots(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointFormatError(f"{index} is not a valid shard index (a JSON object with "
                                        f"a 'weight_map' of tensor -> file): {e!r}") from None
        for s in shards:
            if (not isinstance(s, str) or not s or os.path.isabs(s)
                    or os.path.normpath(s).split(os.sep)[0] == ".."
                    or not _inside(os.path.join(path, s), roots)):
                raise CheckpointFormatError(
                    f"{index} names the shard {s!r}, which is outside the checkpoint directory "
                    f"{path}; shard entries must be files inside it")
        missing = [s for s in shards if not os.path.exists(os.path.join(path, s))]
        if missing:
            raise CheckpointMismatchError(f"{index} names shard files that are missing: {missing}")
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointMismatchError(f"no *.safetensors files in {path}; Glassbox loads "
                                      "safetensors checkpoints (convert .bin with transformers)")
    for file in files:
        if not _inside(file, roots):
            raise CheckpointFormatError(f"{file} is a link to {Path(file).resolve()}, outside "
                                        f"the checkpoint directory {path}; copy the file in")
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


# checkpoint dtypes a parameter takes (cast to the model dtype); ints or bools are never weights
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _open(file: str):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:        # safetensors raises its own SafetensorError (an Exception)
        raise CheckpointFormatError(f"{file} is truncated or corrupt ({e}); download or convert "
                                    "it again") from None


def _load_tensor(param: nn.Parameter, sl, shard) -> set | None:
    """Copy one checkpoint tensor (a lazy slice) into param through its weight_loader; the
    pieces it filled (None: the one named by shard). ValueError when it does not fit."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:          # a plain parameter (norms): exactly its shape, no broadcast
        if tuple(sl.get_shape()) != tuple(param.shape):
            raise ValueError("shapes differ")
        param.data.copy_(sl[:])
        return None
    return loader(param, sl, shard) if shard is not None else loader(param, sl)


def load_weights(model: nn.Module, path: str) -> None:
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {n: set() for n in params}
    unexpected, duplicates = [], []
    tied = getattr(model, "tied", False)
    for file in checkpoint_files(path):
        with _open(file) as f:
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
                sl = f.get_slice(name)
                dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
                if dtype not in _FLOAT_DTYPES:
                    raise CheckpointMismatchError(
                        f"{name} in {file} has dtype {dtype}; parameter {pname} takes floating "
                        f"point weights ({', '.join(_FLOAT_DTYPES)}). Check the checkpoint.")
                try:
                    filled = _load_tensor(param, sl, shard)
                except (ValueError, RuntimeError, IndexError) as e:
                    piece = f" (piece {shard!r})" if shard is not None else ""
                    raise CheckpointMismatchError(
                        f"{name} in {file} has shape {shape}, which does not fit parameter "
                        f"{pname}{piece} of shape {tuple(param.shape)}: {e}. Check that "
                        "config.json belongs to these weights.") from None
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
    problems = [f"{what}: {names[:20]}" + (f" (+{len(names) - 20} more)" if len(names) > 20 else "")
                for what, names in (("missing from the checkpoint", missing),
                                    ("unexpected tensors (no parameter takes them)", unexpected),
                                    ("tensors given twice", duplicates)) if names]
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
        elif p.numel() < (1 << 24):
            p.data.copy_(torch.empty(p.shape, dtype=torch.float32).uniform_(-0.04, 0.04,
                                                                            generator=g))
        else:     # large tensors: draw on the device, chunk by chunk
            p.data.uniform_(-0.04, 0.04)

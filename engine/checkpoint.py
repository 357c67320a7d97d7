"""Checkpoint: what a model directory holds besides its weights — config.json as transformers'
config, the tokenizer, the EOS ids, the context length — read once, never running code shipped
in the checkpoint, every problem a ModelLoadError naming the file and the fix."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .errors import CheckpointFormatError, InvalidArgumentError, UnsupportedArchitectureError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass(frozen=True)
class Checkpoint:
    path: str
    hf_config: object
    tokenizer: object | None        # None: token-id prompts only
    eos_token_ids: frozenset[int]

    @classmethod
    def load(cls, model: str) -> "Checkpoint":
        from .loader import resolve_model_path
        path = resolve_model_path(model)
        hf_config = load_hf_config(path)
        tokenizer = load_tokenizer(path)
        return cls(path, hf_config, tokenizer, frozenset(eos_ids(path, hf_config, tokenizer)))

    def max_model_len(self, asked: int | None) -> int:
        """The context length: `asked`, at most the model's max_position_embeddings."""
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 4096
        if asked is not None and asked > limit:
            raise InvalidArgumentError(f"max_model_len={asked} exceeds the model's "
                                       f"max_position_embeddings={limit}; use at most {limit}",
                                       "max_model_len")
        return asked or limit

    def check_memory(self, config) -> None:
        """Refuse weights that cannot fit the device (or the host) before allocating."""
        import torch

        from .model_size import check_fits, check_fits_host
        size = torch.empty(0, dtype=config.torch_dtype).element_size()
        name = str(config.torch_dtype).replace("torch.", "")
        if config.device.startswith("cuda"):
            check_fits(self.hf_config, config.tensor_parallel_size, size,
                       torch.cuda.get_device_properties(0).total_memory,
                       config.gpu_memory_utilization, name)
        else:
            check_fits_host(self.hf_config, size, name)


def load_hf_config(path: str):
    """config.json -> the transformers config, never running code shipped in the checkpoint."""
    from transformers import AutoConfig

    from .model_size import check_config_sizes
    from .models.registry import model_class, supported_architectures
    file = os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{file} is not valid JSON: {e}; fix or replace the "
                                    "checkpoint's config.json") from None
    except OSError as e:
        raise CheckpointFormatError(f"cannot read {file}: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{file} must hold a JSON object (the model's settings), "
                                    f"got a JSON {type(raw).__name__}")
    try:
        check_config_sizes(raw, file)        # before transformers builds per-layer lists
    except ValueError as e:
        raise CheckpointFormatError(str(e)) from None
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        remote = raw.get("auto_map") and "trust_remote_code" in str(e)
        why = ("it maps its model_type to Python code in the checkpoint (auto_map), and "
               "Glassbox never runs code from a checkpoint" if remote else f"{e}")
        raise UnsupportedArchitectureError(
            f"architecture {raw.get('architectures')} (model_type {raw.get('model_type')!r}) "
            f"cannot be loaded: {why}. Supported: {', '.join(supported_architectures())}") from None
    model_class(cfg)            # raises UnsupportedArchitectureError with a clear message
    return cfg


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, None when it has no tokenizer files (token-id prompts only);
    never one defined by code shipped in the checkpoint."""
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        try:
            with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
                remote = "auto_map" in json.load(f)
        except (OSError, ValueError):
            remote = False
        why = ("its tokenizer_config.json maps the tokenizer to Python code in the checkpoint "
               "(auto_map), and Glassbox never runs code from a checkpoint" if remote
               else f"{type(e).__name__}: {e}")
        raise CheckpointFormatError(f"the tokenizer in {path} cannot be loaded: {why}. Use a "
                                    "checkpoint with a standard tokenizer (tokenizer.json), or "
                                    "remove the tokenizer files to serve token-id prompts only"
                                    ) from None


def eos_ids(path: str, hf_config, tokenizer) -> set[int]:
    """generation_config.json's, config.json's and the tokenizer's EOS ids together."""
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        try:
            with open(gen, encoding="utf-8") as f:
                raw = json.load(f)
            if not isinstance(raw, dict):
                raise ValueError(f"it holds a JSON {type(raw).__name__}, not an object")
            add(raw.get("eos_token_id"))
        except (ValueError, TypeError, OSError) as e:  # JSONDecodeError, bad ids, unreadable
            raise CheckpointFormatError(
                f"{gen} is not a valid generation config: {e}; fix it (eos_token_id must be an "
                "integer or a list of integers) or remove the file") from None
    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids

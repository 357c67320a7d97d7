"""ProbeSpec: which probes to run for one watched request. Types are checked at construction,
the fit to the model by `resolve` when the request is submitted: a bad spec fails its caller
with an InvalidArgumentError whose `param` names the field (`watch.<field>`), not the step.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..sampling_params import is_int


def _layer_tuple(name: str, v, allow_none: bool) -> tuple[int, ...] | None:
    if v is None and allow_none:
        return None
    if not isinstance(v, (list, tuple)) or not all(is_int(l) for l in v):
        what = "None or a list of layer indices" if allow_none else "a list of layer indices"
        raise InvalidArgumentError(f"ProbeSpec.{name} must be {what} (integers; negative "
                                   f"counts from the last layer), got {v!r}", f"watch.{name}")
    return tuple(int(l) for l in v)


@dataclass(frozen=True)
class ProbeSpec:
    norms: bool = True          # hook_embed + blocks.L.hook_resid_post L2 norms, every token
    logit_lens: bool = True     # final norm + LM head on every layer's residual, each new token
    attention: bool = True      # newest query's attention over its context, every layer and head
    routing: bool = True        # MoE router probs / top-k / shared gate per token (MoE models)
    layers: tuple[int, ...] | None = None   # attention layers to capture (None = all)
    lens_top_k: int = 5
    prefill_pattern_layers: tuple[int, ...] = ()   # full prompt pattern for these layers
    prefill_pattern_cap: int = 512                  # ... only for prompts up to this many tokens

    def __post_init__(self):
        for name in ("norms", "logit_lens", "attention", "routing"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"ProbeSpec.{name} must be True or False, "
                                           f"got {getattr(self, name)!r}", f"watch.{name}")
        for name in ("lens_top_k", "prefill_pattern_cap"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise InvalidArgumentError(f"ProbeSpec.{name} must be an integer >= 1, "
                                           f"got {v!r}", f"watch.{name}")
            object.__setattr__(self, name, int(v))
        # lists become tuples: the spec stays hashable and cannot change under the engine
        object.__setattr__(self, "layers", _layer_tuple("layers", self.layers, True))
        object.__setattr__(self, "prefill_pattern_layers", _layer_tuple(
            "prefill_pattern_layers", self.prefill_pattern_layers, False))

    @property
    def any(self) -> bool:
        return self.norms or self.logit_lens or self.attention or self.routing

    def resolve(self, num_layers: int, vocab_size: int) -> "ProbeSpec":
        """This spec for a model with num_layers layers and vocab_size tokens: negative layer
        indices counted from the end (Python style), duplicates dropped; an InvalidArgumentError
        naming the field for a layer outside [-num_layers, num_layers) or lens_top_k >
        vocab_size."""
        def fix(name: str, layers: tuple[int, ...]) -> tuple[int, ...]:
            out: list[int] = []
            for l in layers:
                if not -num_layers <= l < num_layers:
                    raise InvalidArgumentError(
                        f"ProbeSpec.{name}: layer {l} is out of range for this model's "
                        f"{num_layers} layers; valid indices are [-{num_layers}, {num_layers})",
                        f"watch.{name}")
                l %= num_layers
                if l not in out:
                    out.append(l)
            return tuple(out)
        if self.lens_top_k > vocab_size:
            raise InvalidArgumentError(f"ProbeSpec.lens_top_k={self.lens_top_k} exceeds the "
                                       f"model's vocabulary of {vocab_size} tokens; use at most "
                                       f"{vocab_size}", "watch.lens_top_k")
        return dataclasses.replace(
            self, layers=None if self.layers is None else fix("layers", self.layers),
            prefill_pattern_layers=fix("prefill_pattern_layers", self.prefill_pattern_layers))

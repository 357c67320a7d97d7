"""ProbeSpec: which probes to run for one watched request."""
from __future__ import annotations

from dataclasses import dataclass


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
        if self.lens_top_k < 1:
            raise ValueError(f"ProbeSpec.lens_top_k must be >= 1, got {self.lens_top_k}")
        if self.prefill_pattern_cap < 1:
            raise ValueError("ProbeSpec.prefill_pattern_cap must be >= 1")

    @property
    def any(self) -> bool:
        return self.norms or self.logit_lens or self.attention or self.routing

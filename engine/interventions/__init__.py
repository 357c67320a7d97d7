"""Interventions: per-request edits of the forward pass (ablate heads, mask experts, steer the
residual) inside the continuous batch: spec (the public Intervention), plan (per-step host
tables), buffers (the device side the layers read), steering (vectors from two prompts)."""
from .spec import Intervention, ModelFacts, resolve_interventions

__all__ = ["Intervention", "ModelFacts", "resolve_interventions"]

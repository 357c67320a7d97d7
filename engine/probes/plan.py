"""ProbePlan: what the probes record in one step — which flat rows are watched, and for which
probes. Built on rank 0 by the ProbeManager each watched step, sent to every rank with the
step's inputs, read by the ProbeBuffers the forward writes into."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WatchedEntry:
    request_id: str
    batch_index: int            # row of the block tables / context lens
    row_start: int              # first flat token row of this entry
    num_tokens: int
    start_pos: int
    samples: bool
    spec: object                # ProbeSpec
    block_table: list = field(default_factory=list)   # at plan time (freed blocks vanish later)
    # rows sampled at the entry's end: 1, or 1 + k for a verify (speculative decoding), whose
    # rows are all recorded; the verdict keeps those of accepted tokens (ProbeManager.settle)
    num_sampled: int = 1

    @property
    def records_last(self) -> bool:
        """Its sampled rows are recorded (last_rows: the lens, attention)."""
        return self.samples and (self.spec.logit_lens or self.spec.attention)


@dataclass
class ProbePlan:
    """Host-side description of what to record this step (sent to every rank)."""
    entries: list[WatchedEntry]
    # plain lists: the plan is built every watched step, and tensors cost more than the walk
    rows: list[int]                 # [R] flat rows of all watched tokens (norms, routing)
    last_rows: list[int]            # [W] flat rows of watched entries that sample (lens, attention)
    last_batch: list[int]           # [W] their batch indices
    norms: bool
    lens: bool
    lens_top_k: int
    attention_layers: list[int]
    routing: bool
    expert_load: bool
    # layer -> [(row_start, start_pos, m, batch_index)]: the m prompt queries of one watched
    # prefill chunk whose rows of the full prompt pattern are recorded this step
    pattern_layers: dict = field(default_factory=dict)
    sampling_rows: list = field(default_factory=list)     # flat rows sampled this step, in order
    # [W] context length of each last row's query, only when a watched verify is in the step
    # (its rows are queries at successive positions of one sequence); else [] and the
    # attention probe reads each row's batch context length
    last_ctx: list = field(default_factory=list)

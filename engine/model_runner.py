"""Per rank: build the model, load weights, allocate the paged KV cache, turn a scheduled
batch into flat tensors (input_ids, positions, slot_mapping, block tables), run the forward
(eagerly, or by replaying a CUDA graph for decode batches) and return logits."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .config import EngineConfig
from .context import ForwardContext, set_context
from .loader import init_dummy_weights, load_weights
from .models.registry import model_class
from .parallel_state import TPGroup, use_tp


_BUILD_LOCK = threading.Lock()


@dataclass
class StepInputs:
    """One step's batch as host tensors: what rank 0 sends to every rank."""
    input_ids: torch.Tensor         # [N] int64
    positions: torch.Tensor         # [N] int64
    slot_mapping: torch.Tensor      # [N] int64
    context_lens: torch.Tensor      # [B] int32
    block_tables: torch.Tensor      # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor      # [B + 1] int32
    max_seqlen_q: int
    sample_rows: torch.Tensor       # [S] int64: flat rows whose logits are sampled
    is_decode: bool
    probe_plan: object | None = None   # probes.plan.ProbePlan, or None when nothing is watched


def build_step_inputs(scheduled, block_size: int, probe_plan=None) -> StepInputs:
    """Flatten a scheduled batch. Plain Python lists and one numpy block table: this runs on
    every step, serial with the GPU, so per-row tensor creation is avoided."""
    ids, pos, slots, ctx_lens, cu, rows = [], [], [], [], [0], []
    max_q = 0
    max_blocks = max((len(s.seq.block_table) for s in scheduled), default=1) or 1
    table = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
    total = 0
    for i, s in enumerate(scheduled):
        seq, n, start = s.seq, s.num_tokens, s.start
        bt = seq.block_table
        table[i, :len(bt)] = bt
        if n == 1:                                   # decode: no per-token ranges
            ids.append(seq.token_ids[start])
            pos.append(start)
            slots.append(bt[start // block_size] * block_size + start % block_size)
        else:
            ids.extend(seq.token_ids[start:start + n])
            p = range(start, start + n)
            pos.extend(p)
            slots.extend(bt[j // block_size] * block_size + j % block_size for j in p)
        ctx_lens.append(start + n)
        total += n
        cu.append(total)
        if n > max_q:
            max_q = n
        if s.samples:
            rows.append(total - 1)
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(pos, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.from_numpy(table), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        max_seqlen_q=max_q, sample_rows=torch.tensor(rows, dtype=torch.int64),
        is_decode=max_q == 1, probe_plan=probe_plan)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model_path: str, max_model_len: int,
                 tp: TPGroup | None = None):
        self.tp = tp or TPGroup()
        rank = self.tp.rank
        self.config, self.hf_config, self.rank = config, hf_config, rank
        self.device = torch.device(config.device if not config.device.startswith("cuda")
                                   else f"cuda:{rank}" if config.device == "cuda" else config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        # the default dtype is process-wide: engines built at once on two threads take turns
        with _BUILD_LOCK:
            prev = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                with torch.device(self.device), use_tp(self.tp):
                    self.model = model_class(hf_config)(hf_config,
                                                        max_model_len + config.block_size)
            finally:
                torch.set_default_dtype(prev)
        for m in self.model.modules():      # the rotary table stays fp32 like HF's
            if hasattr(m, "cos_sin_cache"):
                m.cos_sin_cache = m.cos_sin_cache.float().to(self.device)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, model_path)
        self.model.eval()
        self.num_layers = hf_config.num_hidden_layers
        attn0 = self.model.attention_layers[0]
        self.num_kv_heads, self.head_dim = attn0.num_kv_heads, attn0.head_dim
        self.num_heads = attn0.num_heads
        self.kv_cache: torch.Tensor | None = None
        self.graphs = None

    # ---- KV cache ----------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def profile_num_blocks(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """How many KV blocks fit: on the GPU, after a profiling forward at the largest
        batch; on the CPU, a bounded share of RAM (never more than max_num_seqs full seqs)."""
        cap = max_num_seqs * ((self.max_model_len + self.block_size - 1) // self.block_size) + 1
        if self.device.type != "cuda":
            try:
                avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError):
                avail = 8 << 30
            budget = min(2 << 30, avail // 4)
            return max(1, min(cap, budget // self.bytes_per_block))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_forward(max_num_batched_tokens, max_num_seqs)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        peak = torch.cuda.max_memory_allocated(self.device)
        cur = torch.cuda.memory_allocated(self.device)
        # graphs and the sampler at max batch need headroom beyond the profiled peak
        graph_reserve = 0 if self.config.enforce_eager else 512 << 20
        budget = total * self.config.gpu_memory_utilization - used - (peak - cur) - graph_reserve
        n = int(budget // self.bytes_per_block)
        if n < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget/2**30:.2f} "
                               "GiB): raise gpu_memory_utilization or use a smaller model")
        return min(n, cap)

    def _profile_forward(self, num_tokens: int, num_seqs: int) -> None:
        num_tokens = min(num_tokens, max(self.max_model_len, 1) * num_seqs)
        n_seqs = max(1, min(num_seqs, num_tokens))
        per = num_tokens // n_seqs
        # a throwaway one-block cache: slots all -1 so nothing is written; every table entry
        # points at that block, so the attention kernels read valid memory for every position
        self.allocate_kv_cache(1)
        d = self.device
        cu = torch.arange(0, n_seqs + 1, device=d, dtype=torch.int32) * per
        width = (per + self.block_size - 1) // self.block_size
        ctx = ForwardContext(
            slot_mapping=torch.full((per * n_seqs,), -1, dtype=torch.int64, device=d),
            context_lens=torch.full((n_seqs,), per, dtype=torch.int32, device=d),
            block_tables=torch.zeros(n_seqs, width, dtype=torch.int32, device=d),
            cu_seqlens_q=cu, max_seqlen_q=per, is_decode=False)
        ids = torch.zeros(per * n_seqs, dtype=torch.int64, device=d)
        with torch.inference_mode():
            set_context(ctx)
            h = self.model(ids, ids)
            logits = self.model.compute_logits(h[:num_seqs])
            torch.softmax(logits.float(), -1).sort(dim=-1)     # the sampler's peak
            set_context(None)
        del h, logits
        self.kv_cache = None
        torch.cuda.synchronize(self.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        # zeros, not empty: masked-out slots are multiplied by 0 in the references, and
        # uninitialised memory may hold NaN bit patterns
        self.kv_cache = torch.zeros(2, self.num_layers, num_blocks, self.block_size,
                                    self.num_kv_heads, self.head_dim, dtype=self.dtype,
                                    device=self.device)
        for i, attn in enumerate(self.model.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        self.model.k_cache_all = self.kv_cache[0]     # the attention probe reads every layer
        self.num_blocks = num_blocks

    # ---- running a step ----------------------------------------------------------------------
    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return x
        return x.pin_memory().to(self.device, non_blocking=True)

    def execute(self, inp: StepInputs, probes=None) -> torch.Tensor:
        """Run the forward eagerly; returns logits [S, vocab] of the sampled rows."""
        d = self.to_device
        ctx = ForwardContext(slot_mapping=d(inp.slot_mapping), context_lens=d(inp.context_lens),
                             block_tables=d(inp.block_tables),
                             cu_seqlens_q=d(inp.cu_seqlens_q), max_seqlen_q=inp.max_seqlen_q,
                             is_decode=inp.is_decode, probes=probes)
        with torch.inference_mode():
            set_context(ctx)
            try:
                hidden = self.model(d(inp.input_ids), d(inp.positions))
                logits = self.model.compute_logits(hidden.index_select(0, d(inp.sample_rows)))
            finally:
                set_context(None)
        return logits

    def capture_graphs(self, max_num_seqs: int) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        from .cuda_graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self, max_num_seqs)

    # ---- the step API the engine core calls (a TP driver offers the same) -------------------
    def execute_step(self, inp: StepInputs):
        """-> (logits [S, vocab], probe buffers or None). Decode batches replay a CUDA graph
        when one fits (with the probe-capturing variant when a request is watched)."""
        plan = inp.probe_plan
        self._graph_bucket = None
        if self.graphs is not None and inp.is_decode and self.graphs.can_run(inp, plan):
            with torch.inference_mode():
                logits, bufs = self.graphs.replay(inp, plan)
        else:
            bufs = None
            if plan is not None:
                from .probes.buffers import ProbeBuffers
                bufs = ProbeBuffers.for_step(self, inp)
            logits = self.execute(inp, bufs)
        if bufs is not None:
            bufs.start_copy()       # the step's one device->host copy, read after the sync
        self._collectives = self.tp.take_collective_count()
        return logits, bufs

    def last_step_info(self) -> dict:
        return {"graph_bucket": getattr(self, "_graph_bucket", None),
                "collectives": getattr(self, "_collectives", 0),
                "expert_load": getattr(self, "_expert_load", None)}

    # ---- facts for inspect() -----------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters()) * self.tp.size

    @property
    def moe_layers(self) -> list[int]:
        return list(getattr(self.model, "moe_layers", []))

    def read_kv_block(self, block_id: int, layer: int, head: int, kv: int):
        if not 0 <= head < self.num_kv_heads:
            raise ValueError(f"head must be in [0, {self.num_kv_heads}) (KV heads on this rank)")
        return self.kv_cache[kv, layer, block_id, :, head].float().cpu().numpy()

    def tp_layout(self) -> list:
        from .probes.tp_layout import rank_layout
        return [rank_layout(self.hf_config, r, self.tp.size, self.bytes_per_block * self.num_blocks)
                for r in range(self.tp.size)]

    def shutdown(self) -> None:
        self.graphs = None

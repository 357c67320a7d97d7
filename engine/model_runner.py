"""Per rank: build the model, load weights, allocate the paged KV cache, stage a step's inputs
on the device, run the forward (eagerly or by replaying a CUDA graph), sample, and return a
StepOutput. Every rank samples the same ids from the gathered logits (the sampler is a pure
function of them), so the next step's pending input ids are on every device already.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch

from .config import EngineConfig
from .context import ForwardContext, set_context
from .kernel_config import KernelConfig
from .loader import init_dummy_weights, load_weights
from .models.registry import model_class
from .parallel_state import TPGroup, use_tp
from .penalties import PenaltyState
from .sampling import SamplingTensors, sample
from .step_inputs import StepInputs
from .step_output import StepOutput


_BUILD_LOCK = threading.Lock()
CPU_FULL_SEQS = 16      # the CPU KV cache's default: this many full-length sequences


class ModelRunner:
    # a guided step's bitmask may come as a callable, run after the forward's launch (the
    # engine core then keeps overlap scheduling on for guided requests)
    fills_masks_late = True

    def __init__(self, config: EngineConfig, hf_config, model_path: str, max_model_len: int,
                 tp: TPGroup | None = None, kernel_config: KernelConfig | None = None):
        self.tp = tp or TPGroup()
        rank = self.tp.rank
        self.config, self.hf_config = config, hf_config
        # the kernel and fusion choices every layer of this rank's model runs with
        self.kernel_config = kernel_config if kernel_config is not None \
            else KernelConfig.build(config)
        self.device = torch.device(f"cuda:{rank}" if config.device == "cuda" else config.device)
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
                                                        max_model_len + config.block_size,
                                                        self.kernel_config)
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
        self.prefill_graphs = None          # prefill_graphs.PrefillGraphs (GPU, not eager)
        self._last_sampled: tuple[int, torch.Tensor | None] = (-1, None)
        # penalised requests' output-token counts, kept on the device across steps
        self.penalty_state = PenaltyState(self.device)
        self._events = None                 # step_output.StepEvents, made on the first GPU step

    # ---- KV cache ----------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def profile_num_blocks(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """How many KV blocks fit: on the GPU, after a profiling forward at the largest
        batch (never more than max_num_seqs full-length sequences); on the CPU, room for
        CPU_FULL_SEQS full-length sequences (at least 64 blocks) within a bounded share of RAM:
        a cache a laptop can hold, sized so the KV view shows it in use, not a sea of empty
        blocks."""
        per_seq = (self.max_model_len + self.block_size - 1) // self.block_size
        cap = max_num_seqs * per_seq + 1
        if self.device.type != "cuda":
            try:
                avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError):
                avail = 8 << 30
            budget = min(2 << 30, avail // 4)
            want = max(64, CPU_FULL_SEQS * per_seq)
            return max(1, min(cap, want, budget // self.bytes_per_block))
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
    def stage(self, a: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor (pinned, non-blocking on a GPU)."""
        t = torch.from_numpy(a)
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def prev_sampled(self, inp: StepInputs) -> torch.Tensor | None:
        """The previous step's sampled ids on this device, for the step's pending input rows."""
        if not len(inp.pending_rows):
            return None
        step, ids = self._last_sampled
        if step != inp.prev_step_id:
            raise RuntimeError(f"step {inp.step_id} needs the ids sampled by step "
                               f"{inp.prev_step_id}, but this rank holds step {step}'s")
        return ids

    def execute(self, inp: StepInputs, probes=None, interventions=None,
                out: StepOutput | None = None) -> torch.Tensor:
        """Run the forward eagerly; returns logits [S, vocab] of the sampled rows. With `out`
        and rows that asked for prompt logprobs, their host copies go to
        out.prompt_logprobs_host."""
        d = self.stage
        ctx = ForwardContext(slot_mapping=d(inp.slot_mapping), context_lens=d(inp.context_lens),
                             block_tables=d(inp.block_tables),
                             cu_seqlens_q=d(inp.cu_seqlens_q), max_seqlen_q=inp.max_seqlen_q,
                             is_decode=inp.is_decode, probes=probes,
                             interventions=interventions, cascade=self.cascade_inputs(inp))
        input_ids = d(inp.input_ids)
        if len(inp.pending_rows):       # sampled by the step before, still on the device
            if self.device.type == "cpu":
                input_ids = input_ids.clone()       # from_numpy shares the message's memory
            input_ids.index_copy_(0, d(inp.pending_rows),
                                  self.prev_sampled(inp).index_select(0, d(inp.pending_src)))
        with torch.inference_mode():
            set_context(ctx)
            try:
                hidden = self.model(input_ids, d(inp.positions))
                logits = self.model.compute_logits(hidden.index_select(0, d(inp.sample_rows)))
                if out is not None and inp.prompt_lp_rows is not None:
                    # every rank: the LM head gathers its logits over TP ranks (a collective)
                    from .prompt_logprobs import prompt_logprobs
                    res = prompt_logprobs(self.model.compute_logits, hidden,
                                          d(inp.prompt_lp_rows), d(inp.prompt_lp_targets),
                                          inp.prompt_lp_k)
                    if self.tp.rank == 0:
                        out.prompt_logprobs_host = tuple(self._to_host(x) for x in res)
            finally:
                set_context(None)
        return logits

    def cascade_inputs(self, inp: StepInputs):
        """The step's cascade (engine/cascade.py) as the kernels read it, or None."""
        c = inp.cascade
        if c is None or not inp.is_decode:
            return None
        from .kernels.cascade_attention import CascadeInputs
        return CascadeInputs(self.stage(c.first), self.stage(np.array([c.lead], np.int32)),
                             inp.block_tables.shape[1] * self.block_size)

    def capture_graphs(self, max_num_seqs: int) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        from .cuda_graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self, max_num_seqs)
        if self.kernel_config.prefill_graphs:
            from .prefill_graphs import PrefillGraphs
            self.prefill_graphs = PrefillGraphs(self, self.config.max_num_batched_tokens)

    # ---- the step API the engine core calls (a TP driver offers the same) -------------------
    def execute_step(self, inp: StepInputs) -> StepOutput:
        """Launch one step: the forward (a CUDA graph for decode batches when one fits, with the
        probe-capturing variant when a request is watched), then sampling, all queued on the
        device. Returns at once; the host copies are in flight (StepOutput.wait())."""
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        plan = inp.probe_plan
        timer = self.tp.start_step()
        out = StepOutput(step_id=inp.step_id, sampled_ids=None)
        replayed = 0
        ivs = None      # interventions' device tables (None: no request in the step has any)
        if cuda:
            if self._events is None:
                from .step_output import StepEvents
                self._events = StepEvents(self.device)
            stream = self._events.stream()
            out.gpu_start, out.gpu_end, out.done = self._events.take()
            out.gpu_start.record(stream)
        with torch.inference_mode():
            if self.graphs is not None and inp.is_decode and inp.prompt_lp_rows is None and \
                    self.graphs.can_run(inp, plan):
                logits, bufs, out.graph_bucket, timer, replayed, out.cascade = \
                    self.graphs.replay(inp, plan)
            elif self.prefill_graphs is not None and self.prefill_graphs.can_run(inp, plan):
                # a short prefill (a chat turn, watched or not): one replay instead of ~270
                # eager launches
                timer = None
                logits, bufs, out.graph_bucket, replayed = self.prefill_graphs.replay(inp, plan)
            else:
                bufs = None
                if plan is not None:
                    from .probes.buffers import ProbeBuffers
                    bufs = ProbeBuffers.for_step(self, inp)
                if inp.interventions is not None:
                    from .interventions.buffers import InterventionBuffers
                    ivs = InterventionBuffers.for_step(self, inp.interventions)
                logits = self.execute(inp, bufs, ivs, out)
                out.cascade = inp.cascade is not None and inp.is_decode
            if inp.sampling is not None and len(inp.sampling):
                if inp.sampling.grammar_mask_fn is not None:    # the forward is queued: fill
                    inp.sampling.grammar_mask = inp.sampling.grammar_mask_fn()   # in its shadow
                    inp.sampling.grammar_mask_fn = None
                prev = self._last_sampled
                st = SamplingTensors.from_batch(inp.sampling, self.device)
                if inp.sampling.penalties is not None:
                    st.penalties = self.penalty_state.step(
                        inp.sampling.penalties, logits.shape[-1],
                        prev[1] if prev[0] == inp.prev_step_id else None)
                ids, chosen, top_ids, top_lp = sample(logits, st)
                out.sampled_ids = ids
                self._last_sampled = (inp.step_id, ids)
                if self.tp.rank == 0:       # only rank 0 reads results on the host
                    out.sampled_host = self._to_host(ids)
                    if chosen is not None:
                        out.logprobs_host = tuple(map(self._to_host, (chosen, top_ids, top_lp)))
            if bufs is not None and self.tp.rank == 0:
                from .probes.manager import ProbeManager
                out.probes = bufs.finish(out.sampled_ids, plan, ProbeManager.sample_index(plan),
                                         self.block_size)
            if ivs is not None and self.tp.rank == 0:   # steering vectors: summed resid_post
                sums = ivs.captured_sums()
                if sums is not None:
                    out.resid_captures = self._to_host(sums)
        out.collectives = self.tp.take_collective_count() + replayed
        out.collective_timer = timer
        if cuda:
            out.gpu_end.record(stream)
            out.done.record(stream)
        out.t_launch = time.perf_counter() - t0
        return out

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return x
        h = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return h.copy_(x, non_blocking=True)

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
        from .tp_layout import rank_layout
        return [rank_layout(self.hf_config, r, self.tp.size, self.bytes_per_block * self.num_blocks)
                for r in range(self.tp.size)]

    def check_workers(self) -> None:
        """The Runner protocol's worker check: one process has no worker to lose."""

    def shutdown(self) -> None:
        """Release the weights, the KV cache and the graphs (a later engine in this process
        gets the memory back)."""
        self.graphs = self.prefill_graphs = None
        self._last_sampled = (-1, None)
        self.penalty_state = PenaltyState(self.device)
        self.kv_cache = None
        if getattr(self, "model", None) is not None:
            for attn in self.model.attention_layers:
                attn.k_cache = attn.v_cache = None
            self.model.k_cache_all = None
            self.model = None
        if self.device.type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()

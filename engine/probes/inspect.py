"""take_snapshot: a host-side copy of the engine's state for views and tests (under the lock)."""
from __future__ import annotations


from .snapshot import BlockInfo, EngineSnapshot, KVLayout


def take_snapshot(llm) -> EngineSnapshot:
    bm, sched, runner = llm.block_manager, llm.scheduler, llm.runner
    bs = bm.block_size
    owners: dict[int, list[str]] = {}
    filled: dict[int, list[int]] = {}
    tables, tokens = {}, {}
    for seq in sched.all_sequences():
        if not seq.block_table:
            continue
        tables[seq.request_id] = list(seq.block_table)
        tokens[seq.request_id] = seq.num_computed_tokens
        for i, bid in enumerate(seq.block_table):
            owners.setdefault(bid, []).append(seq.request_id)
            # a token still on the device (overlap scheduling) has no id here yet
            known = min(seq.num_computed_tokens, seq.num_resolved_tokens)
            ids = seq.token_ids[i * bs:min((i + 1) * bs, known)]
            if len(ids) > len(filled.get(bid, [])):
                filled[bid] = ids
    blocks = []
    for b in bm.blocks:
        ids = filled.get(b.block_id) or (list(b.token_ids) if b.prefix_hash is not None else [])
        blocks.append(BlockInfo(b.block_id, b.ref_count, owners.get(b.block_id, []), len(ids),
                                b.prefix_hash, b.ref_count == 0 and b.prefix_hash is not None,
                                list(ids)))
    kv = runner.kv_cache
    elem = kv.element_size()
    per_block = runner.bytes_per_block
    cfg = llm.hf_config
    moe = None
    if getattr(runner, "moe_layers", None):
        moe = {"num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
               "moe_layers": list(runner.moe_layers)}
    used = bm.num_blocks - bm.num_free_blocks
    steps = list(llm.core.steps)
    timed = next((st for st in reversed(steps) if st.collective_time is not None
                  and not st.num_prefill_tokens), None)
    return EngineSnapshot(
        model_name=llm.model_name, architecture=llm.architecture, num_params=llm.num_params,
        dtype=str(llm.dtype).replace("torch.", ""), device=llm.device, tp_size=llm.tp_size,
        block_size=bs, num_blocks=bm.num_blocks, blocks=blocks, block_tables=tables,
        request_tokens=tokens, running=[s.request_id for s in sched.running],
        waiting=[s.request_id for s in sched.waiting], num_free_blocks=bm.num_free_blocks,
        usage=used / bm.num_blocks, prefix_hits=bm.prefix_hits, prefix_queries=bm.prefix_queries,
        evictions=bm.evictions, preemptions=sched.num_preemptions, steps=steps,
        kv_layout=KVLayout(tuple(kv.shape), str(kv.dtype).replace("torch.", ""), per_block,
                           per_block // bs, kv.numel() * elem),
        tp_layout=runner.tp_layout(), moe=moe, num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        collective_time=timed.collective_time if timed else None,
        collective_time_step=timed.step_id if timed else None,
        async_scheduling=llm.async_scheduling)

"""RequestTrace: what the probes recorded for one watched request, as numpy arrays.

Keys follow TransformerLens hook names (`hook_embed`, `blocks.{L}.hook_resid_post`,
`blocks.{L}.attn.hook_pattern`, `blocks.{L}.mlp.hook_router_scores`) so an export can be
reopened next to a TransformerLens cache.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class LensStep:
    """Logit lens for one generated token: every layer's residual through final norm + head."""
    position: int               # position of the query token whose next token this predicts
    sampled_token: int
    top_ids: np.ndarray         # [num_layers, k]
    top_probs: np.ndarray       # [num_layers, k]
    sampled_rank: np.ndarray    # [num_layers] rank of the sampled token (0 = top)
    sampled_prob: np.ndarray    # [num_layers]
    entropy: np.ndarray         # [num_layers] nats


_LENS_ARRAYS = ("top_ids", "top_probs", "sampled_rank", "sampled_prob", "entropy")
# RequestTrace's per-token MoE rows -> their TransformerLens hook (blocks.{L}.mlp.<hook>)
_MOE_HOOKS = (("router_probs", "hook_router_scores"), ("router_topk_ids", "hook_router_topk_ids"),
              ("router_topk_weights", "hook_router_topk_weights"),
              ("shared_expert_gate", "hook_shared_expert_gate"))


class AttentionStep:
    """Attention of the newest query token over its whole context, rebuilt from the paged K cache.

    On a GPU the rows stay on the device until a reader uses them or the AttentionStore moves
    them (attention_store.py); either way `probs` is a host array holding the same values."""
    __slots__ = ("position", "layers", "_probs", "block_table", "block_size", "_layer_rows")

    def __init__(self, position: int, layers: list[int], probs, block_table: list[int],
                 block_size: int):
        self.position = position    # query position (context length - 1)
        self.layers = layers
        self._probs = probs         # [len(layers), num_heads, position + 1]: numpy or a tensor
        self.block_table = block_table      # physical blocks holding the context, in order
        self.block_size = block_size
        self._layer_rows: dict[int, np.ndarray] = {}    # layer index -> [heads, ctx], moved alone

    def __repr__(self) -> str:
        where = "host" if self.on_host else "device"
        return f"AttentionStep(position={self.position}, layers={len(self.layers)}, {where})"

    @property
    def probs(self) -> np.ndarray:
        """[len(layers), num_heads, position + 1] on the host (moved on first use)."""
        if not isinstance(self._probs, np.ndarray):
            move_to_host([self], side_stream())   # a racing reader or spill is harmless:
        return self._probs                        # the same values either way

    def layer_probs(self, index: int) -> np.ndarray:
        """[num_heads, position + 1] of the index-th captured layer on the host: a view shows
        one layer at a time, so only that layer's rows cross (1/28 of the bytes at 0.6B)."""
        if self.on_host:
            return self._probs[index]
        got = self._layer_rows.get(index)
        if got is None:
            rows = self.device_rows
            got = self._probs[index] if rows is None else rows_to_host(rows[index],
                                                                       side_stream())
            self._layer_rows[index] = got
        return got

    @property
    def on_host(self) -> bool:
        return isinstance(self._probs, np.ndarray)

    @property
    def device_rows(self):
        """The rows as the step left them (a device tensor), or None once on the host."""
        return None if self.on_host else self._probs

    def set_host(self, probs: np.ndarray) -> None:
        """The same rows, moved to the host by the attention store."""
        if not self.on_host:
            probs.flags.writeable = False
            self._probs = probs

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._probs.shape)

    def block_mass(self, layer_index: int | None = None, head: int | None = None) -> np.ndarray:
        """Probability mass per KV block: [len(layers), num_heads, num_blocks], or [num_blocks]
        for one (layer index, head) — what a view shows, without summing every other row."""
        n = len(self.block_table)
        probs = self.probs if layer_index is None else self.layer_probs(layer_index)[head]
        pad = n * self.block_size - probs.shape[-1]
        p = np.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, pad)])
        return p.reshape(*p.shape[:-1], n, self.block_size).sum(-1)


@dataclass
class RequestTrace:
    """Everything recorded for one watched request, token by token."""
    request_id: str
    num_layers: int
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)     # one per prompt+output token
    # residual norms of processed tokens: row t = token at position t, col 0 = hook_embed,
    # col l + 1 = blocks.l.hook_resid_post
    resid_norms: list[np.ndarray] = field(default_factory=list)   # each [num_layers + 1]
    lens: list[LensStep] = field(default_factory=list)
    attention: list[AttentionStep] = field(default_factory=list)
    # full attention pattern of the prompt for chosen layers (capped, see ProbeSpec)
    # rows are filled chunk by chunk; rows of queries served by the prefix cache were never
    # computed in this request: they are NaN and `prefill_computed` says so
    prefill_pattern: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [H, P, P]
    prefill_computed: np.ndarray | None = None      # [P] bool: query rows computed here
    # MoE routing per processed token: rows align with resid_norms
    router_probs: list[np.ndarray] = field(default_factory=list)        # each [moe_layers, E]
    router_topk_ids: list[np.ndarray] = field(default_factory=list)     # each [moe_layers, k]
    router_topk_weights: list[np.ndarray] = field(default_factory=list)  # each [moe_layers, k]
    shared_expert_gate: list[np.ndarray] = field(default_factory=list)  # each [moe_layers]
    moe_layers: list[int] = field(default_factory=list)
    finished: bool = False
    # what was done to the forward (Intervention.to_dict(): kind, layer, heads / experts /
    # vector, scale, positions); [] for an untouched run
    interventions: list[dict] = field(default_factory=list)
    # speculative decoding: every verify of this request (spec_decode.DraftVerdict), in order;
    # the rows above describe accepted tokens only, as plain decoding would (the query at
    # position p of a verify's lens step chose the token at p + 1, correction or bonus)
    drafts: list = field(default_factory=list)
    # the engine's own trace is live; what LLM.trace() hands out is a frozen copy
    live: bool = field(default=True, repr=False, compare=False)
    # set when a frozen copy shares this trace's pattern arrays: the engine copies them before
    # writing the next chunk into them (copy on write), so a copy never changes after the fact
    patterns_shared: bool = field(default=False, repr=False, compare=False)

    _ROWS = ("prompt_token_ids", "output_token_ids", "token_texts", "resid_norms", "lens",
             "attention", "router_probs", "router_topk_ids", "router_topk_weights",
             "shared_expert_gate", "moe_layers", "drafts")

    def frozen(self) -> "RequestTrace":
        """A copy of the rows committed so far that the engine never changes afterwards. Takes
        O(rows) reference copies and no array copies: row arrays are never written in place
        (a recomputed row replaces the old one), pattern arrays are copied on write, and the
        shared ones are made read-only."""
        c = copy.copy(self)
        for name in self._ROWS:
            setattr(c, name, list(getattr(self, name)))
        c.prefill_pattern = dict(self.prefill_pattern)
        for a in (*self.prefill_pattern.values(), self.prefill_computed):
            if a is not None:
                a.flags.writeable = False
        self.patterns_shared = bool(self.prefill_pattern) or self.prefill_computed is not None
        c.live = False
        c.patterns_shared = False
        return c

    # ---- dense views -------------------------------------------------------------------
    def norms(self) -> np.ndarray:
        """[num_tokens, num_layers + 1] residual norms (col 0 = embeddings)."""
        if not self.resid_norms:
            return np.zeros((0, self.num_layers + 1), np.float32)
        return np.stack(self.resid_norms)

    def routing(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(probs [T, moe_layers, E], topk_ids [T, moe_layers, k], topk_weights) or None."""
        if not self.router_probs:
            return None
        return (np.stack(self.router_probs), np.stack(self.router_topk_ids),
                np.stack(self.router_topk_weights))

    # ---- export ------------------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        """Flat dict keyed by TransformerLens hook names (norms are per-token L2 norms)."""
        out: dict[str, np.ndarray] = {}
        n = self.norms()
        if len(n):
            out["hook_embed.norm"] = n[:, 0]
            for layer in range(self.num_layers):
                out[f"blocks.{layer}.hook_resid_post.norm"] = n[:, layer + 1]
        for i, st in enumerate(self.attention):
            for j, layer in enumerate(st.layers):
                out[f"blocks.{layer}.attn.hook_pattern.step{i}"] = st.probs[j]
        for layer, pat in self.prefill_pattern.items():
            out[f"blocks.{layer}.attn.hook_pattern.prefill"] = pat
        if self.prefill_computed is not None:
            out["prefill_pattern.computed"] = self.prefill_computed
        for name, hook in _MOE_HOOKS:
            if self.router_probs and getattr(self, name):
                rows = np.stack(getattr(self, name))            # [T, moe_layers, ...]
                for j, layer in enumerate(self.moe_layers):
                    out[f"blocks.{layer}.mlp.{hook}"] = rows[:, j]
        if self.lens:
            for name in _LENS_ARRAYS:
                out[f"logit_lens.{name}"] = np.stack([getattr(s, name) for s in self.lens])
        return out

    def export(self, path: str | Path) -> Path:
        """Write `path` (.npz of arrays) and `path`.json (token ids, texts, layout)."""
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_suffix(".npz")
        arrays = self.to_arrays()
        for i, iv in enumerate(self.interventions):     # steering vectors: arrays, not JSON
            if iv.get("vector") is not None:
                arrays[f"interventions.{i}.vector"] = np.asarray(iv["vector"], np.float32)
        np.savez_compressed(path, **arrays)
        meta = {
            "request_id": self.request_id, "num_layers": self.num_layers,
            "prompt_token_ids": self.prompt_token_ids, "output_token_ids": self.output_token_ids,
            "token_texts": self.token_texts, "moe_layers": self.moe_layers,
            "attention": [{"position": s.position, "layers": s.layers,
                           "block_table": s.block_table, "block_size": s.block_size}
                          for s in self.attention],
            "lens": [{"position": s.position, "sampled_token": s.sampled_token} for s in self.lens],
            "interventions": [{k: v for k, v in iv.items() if k != "vector"}
                              for iv in self.interventions],
            "drafts": [_verdict_dict(v) for v in self.drafts],
        }
        path.with_suffix(".json").write_text(json.dumps(meta))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "RequestTrace":
        """Read back what `export` wrote."""
        path = Path(path).with_suffix(".npz")
        meta = json.loads(path.with_suffix(".json").read_text())
        arr = dict(np.load(path))
        t = cls(request_id=meta["request_id"], num_layers=meta["num_layers"],
                prompt_token_ids=meta["prompt_token_ids"],
                output_token_ids=meta["output_token_ids"], token_texts=meta["token_texts"],
                moe_layers=meta["moe_layers"])
        if "hook_embed.norm" in arr:
            cols = [arr["hook_embed.norm"]] + [arr[f"blocks.{l}.hook_resid_post.norm"]
                                               for l in range(t.num_layers)]
            t.resid_norms = list(np.stack(cols, axis=1))
        for i, a in enumerate(meta["attention"]):
            probs = np.stack([arr[f"blocks.{l}.attn.hook_pattern.step{i}"] for l in a["layers"]])
            t.attention.append(AttentionStep(a["position"], a["layers"], probs,
                                             a["block_table"], a["block_size"]))
        for k, v in arr.items():
            if k.endswith("hook_pattern.prefill"):
                t.prefill_pattern[int(k.split(".")[1])] = v
        if "prefill_pattern.computed" in arr:
            t.prefill_computed = arr["prefill_pattern.computed"]
        for name, hook in _MOE_HOOKS:
            if t.moe_layers and f"blocks.{t.moe_layers[0]}.mlp.{hook}" in arr:
                setattr(t, name, list(np.stack([arr[f"blocks.{l}.mlp.{hook}"]
                                                for l in t.moe_layers], 1)))
        for i, iv in enumerate(meta.get("interventions", [])):
            key = f"interventions.{i}.vector"
            t.interventions.append({**iv, "vector": arr[key].tolist()} if key in arr else iv)
        if meta.get("drafts"):
            from ..spec_decode.state import DraftVerdict
            t.drafts = [DraftVerdict(**_verdict_args(d)) for d in meta["drafts"]]
        for i, s in enumerate(meta["lens"]):
            t.lens.append(LensStep(s["position"], s["sampled_token"],
                                   *(arr[f"logit_lens.{name}"][i] for name in _LENS_ARRAYS)))
        return t


def _verdict_dict(v) -> dict:
    """A DraftVerdict as JSON: its fields (optional ones, e.g. a draft model's guesses, as
    lists where set)."""
    import dataclasses
    out = {}
    for f in dataclasses.fields(v):
        x = getattr(v, f.name)
        out[f.name] = np.asarray(x).tolist() if isinstance(x, (tuple, np.ndarray)) else x
    return out


def _verdict_args(d: dict) -> dict:
    """_verdict_dict's JSON back as DraftVerdict arguments (sequences as tuples)."""
    def tup(x):
        return tuple(tup(y) for y in x) if isinstance(x, list) else x
    return {k: tup(v) for k, v in d.items()}


# ---- device rows to host memory, off the engine's stream (AttentionStep, AttentionStore) ----
_SIDE = None


def side_stream():
    """One CUDA stream for moving finished rows to the host (None without CUDA): its copies
    never queue behind the engine's launched steps, whose outputs they do not need."""
    global _SIDE
    import torch
    if _SIDE is None and torch.cuda.is_available():
        _SIDE = torch.cuda.Stream()
    return _SIDE


def _staged(t, stream) -> np.ndarray:
    """A CUDA tensor to a new host array through pinned staging on `stream` (None: the
    current one); the pinned block returns to torch's cache, reused rather than re-pinned."""
    import torch
    with torch.cuda.stream(stream):
        staging = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        staging.copy_(t, non_blocking=True)
        done = torch.cuda.Event(blocking=True)     # the waiter sleeps: no spinning in the
        done.record()                             # driver beside the engine thread's launches
    done.synchronize()
    return staging.numpy().copy()


def rows_to_host(rows, stream) -> np.ndarray:
    """One device tensor to a read-only host array."""
    out = rows.numpy() if rows.device.type != "cuda" else _staged(rows, stream)
    out.flags.writeable = False
    return out


def move_to_host(steps: list, stream) -> None:
    """Many steps' rows to the host in one copy, joined on the device. On a side stream the
    copy does not queue behind the engine's work: the steps that wrote the rows were waited for."""
    pairs = [(st, st.device_rows) for st in steps]      # read once: a reader may move one
    pairs = [(st, rows) for st, rows in pairs if rows is not None]
    if not pairs:
        return
    if pairs[0][1].device.type != "cuda":
        for st, rows in pairs:
            st.set_host(rows.numpy())
        return
    import torch
    with torch.cuda.stream(stream):
        flat = torch.cat([rows.reshape(-1) for _, rows in pairs]) if len(pairs) > 1 else \
            pairs[0][1].reshape(-1)
    host = _staged(flat, stream)
    del flat
    off = 0
    for st, rows in pairs:
        n = rows.numel()
        st.set_host(host[off:off + n].reshape(tuple(rows.shape)))
        off += n

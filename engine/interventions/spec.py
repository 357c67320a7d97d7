"""Intervention: one edit of the forward pass for one request — ablate attention heads, mask
MoE experts, steer the residual stream, or clamp heads' attention to chosen key positions.
Types are checked at construction, the fit to the model by `resolve_interventions` when the
request is submitted, so a bad spec fails its caller, never the engine step.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import numpy as np

from ..errors import InvalidArgumentError
from ..sampling_params import is_int, is_number

KINDS = ("ablate_heads", "mask_experts", "steer", "clamp_attention")
# a clamp's key positions live in fixed device tables (CUDA graphs): this many per clamp at most
MAX_CLAMP_POSITIONS = 64
# a clamp's key positions are absolute token positions, held as int64 in the step's tables and
# compared with int32 positions on the device: anything at or past this could never be a
# position of any model (resolve_interventions bounds them by the model's max_model_len)
MAX_POSITION = (1 << 31) - 1
POSITIONS = ("all", "prompt", "generated")
MAX_INTERVENTIONS = 64      # per request: each is host work in every step the request is in
# |vector x scale| per entry: past half fp16's range the residual it is added to overflows
MAX_STEER = 32752.0
CAPTURE = "_capture"        # internal: sum of resid_post over the prompt (steering vectors)


def _ids(kind: str, field: str, v) -> tuple[int, ...]:
    if hasattr(v, "tolist") and not isinstance(v, (list, tuple)):
        v = v.tolist()
    if is_int(v):
        v = [v]
    if not isinstance(v, (list, tuple)) or not v or not all(is_int(i) for i in v):
        raise ValueError(f"Intervention.{kind}: {field} must be a non-empty list of integer "
                         f"indices, got {v!r}")
    return tuple(sorted({int(i) for i in v}))


def _vector(v) -> np.ndarray:
    if hasattr(v, "detach"):                    # a torch tensor, on any device
        v = v.detach().float().cpu().numpy()
    try:
        a = np.array(v, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"Intervention.steer: vector must be a 1-D list of numbers (or a "
                         f"numpy array / torch tensor), got {type(v).__name__}") from None
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"Intervention.steer: vector must be 1-D with hidden_size entries, "
                         f"got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("Intervention.steer: vector holds NaN or infinite entries")
    a.setflags(write=False)                     # the spec cannot change under the engine
    return a


@dataclass(frozen=True, eq=False)
class Intervention:
    """One edit. Build with the constructors below, not directly."""
    kind: str
    layer: int
    heads: tuple[int, ...] = ()
    experts: tuple[int, ...] = ()
    vector: np.ndarray | None = None            # [hidden] fp32, steer only
    scale: float = 1.0
    positions: str = "all"
    key_positions: tuple[int, ...] = ()         # clamp_attention only: the keys it may see

    # ---- constructors (the public API) ----------------------------------------------------
    @classmethod
    def ablate_heads(cls, layer: int, heads) -> "Intervention":
        """Zero these attention heads' slice of the attention output (before o_proj) at
        `layer`, for every token of the request."""
        return cls("ablate_heads", _layer("ablate_heads", layer), heads=_ids("ablate_heads", "heads", heads))

    @classmethod
    def mask_experts(cls, layer: int, experts) -> "Intervention":
        """Set these experts' router logits to -inf before the softmax and top-k at MoE layer
        `layer`: they are never picked; the rest of the routing (renormalisation included)
        is the model's own."""
        return cls("mask_experts", _layer("mask_experts", layer),
                   experts=_ids("mask_experts", "experts", experts))

    @classmethod
    def steer(cls, layer: int, vector, scale: float = 1.0,
              positions: str = "all") -> "Intervention":
        """Add vector * scale to the output of decoder layer `layer` (TransformerLens'
        blocks.{layer}.hook_resid_post) at the prompt tokens' positions ("prompt"), at the
        generated tokens' positions ("generated"), or at both ("all"). The first generated
        token is predicted from the last prompt position, so "generated" changes the reply
        from its second token on (as a hook on HF's decode steps does)."""
        if not is_number(scale) or not math.isfinite(scale):
            raise ValueError(f"Intervention.steer: scale must be a finite number, got {scale!r}")
        if positions not in POSITIONS:
            raise ValueError(f"Intervention.steer: positions must be one of {POSITIONS}, "
                             f"got {positions!r}")
        return cls("steer", _layer("steer", layer), vector=_vector(vector), scale=float(scale),
                   positions=positions)

    @classmethod
    def clamp_attention(cls, layer: int, heads, positions) -> "Intervention":
        """These heads at `layer` attend only to the keys at these absolute positions of the
        request (0 = its first prompt token): every other key's score is -inf before the
        softmax, so the attention renormalises over the chosen keys the query can see
        (causality still holds). A query that sees none of them (all in its future) gets a zero
        output from those heads. At most MAX_CLAMP_POSITIONS positions."""
        keys = _ids("clamp_attention", "positions", positions)
        if keys[0] < 0 or keys[-1] >= MAX_POSITION:
            bad = keys[0] if keys[0] < 0 else keys[-1]
            raise ValueError(f"Intervention.clamp_attention: positions are absolute token "
                             f"positions in [0, {MAX_POSITION}) (0 = the first prompt token), "
                             f"got {bad}")
        if len(keys) > MAX_CLAMP_POSITIONS:
            raise ValueError(f"Intervention.clamp_attention: {len(keys)} positions given, at "
                             f"most {MAX_CLAMP_POSITIONS} are supported")
        return cls("clamp_attention", _layer("clamp_attention", layer),
                   heads=_ids("clamp_attention", "heads", heads), key_positions=keys)

    @classmethod
    def _capture(cls, layer: int) -> "Intervention":
        return cls(CAPTURE, _layer("capture", layer))

    # ---- serialisation (API bodies, trace exports) -----------------------------------------
    @classmethod
    def from_dict(cls, d) -> "Intervention":
        """{"kind": "ablate_heads", "layer": 1, "heads": [0, 3]} | {"kind": "mask_experts",
        "layer": 0, "experts": [2]} | {"kind": "steer", "layer": 2, "vector": [...],
        "scale": 4.0, "positions": "generated"} | {"kind": "clamp_attention", "layer": 1,
        "heads": [2], "positions": [0, 5]}."""
        if not isinstance(d, dict):
            raise ValueError(f"an intervention must be an object with a 'kind', got {d!r:.80}")
        kind = d.get("kind")
        required = {"ablate_heads": ("layer", "heads"), "mask_experts": ("layer", "experts"),
                    "steer": ("layer", "vector"),
                    "clamp_attention": ("layer", "heads", "positions")}
        if kind not in required:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        allowed = {"kind", *required[kind], *(("scale", "positions") if kind == "steer" else ())}
        extra = set(d) - allowed
        if extra:
            raise ValueError(f"unknown field(s) {sorted(extra)} for kind {kind!r}; "
                             f"allowed: {sorted(allowed)}")
        for m in required[kind]:
            if m not in d:
                raise ValueError(f"kind {kind!r} needs the field {m!r}")
        if kind == "ablate_heads":
            return cls.ablate_heads(d["layer"], d["heads"])
        if kind == "mask_experts":
            return cls.mask_experts(d["layer"], d["experts"])
        if kind == "clamp_attention":
            return cls.clamp_attention(d["layer"], d["heads"], d["positions"])
        return cls.steer(d["layer"], d["vector"], d.get("scale", 1.0), d.get("positions", "all"))

    def to_dict(self, with_vector: bool = True) -> dict:
        out: dict = {"kind": self.kind, "layer": self.layer}
        if self.kind == "ablate_heads":
            out["heads"] = list(self.heads)
        elif self.kind == "mask_experts":
            out["experts"] = list(self.experts)
        elif self.kind == "clamp_attention":
            out.update(heads=list(self.heads), positions=list(self.key_positions))
        elif self.kind == "steer":
            out.update(scale=self.scale, positions=self.positions,
                       vector_norm=float(np.linalg.norm(self.vector)),
                       vector_sha256=hashlib.sha256(self.vector.tobytes()).hexdigest()[:16])
            if with_vector:
                out["vector"] = self.vector.tolist()
        return out

    def describe(self) -> str:
        if self.kind == "ablate_heads":
            return f"ablate heads {list(self.heads)} at layer {self.layer}"
        if self.kind == "mask_experts":
            return f"mask experts {list(self.experts)} at layer {self.layer}"
        if self.kind == "clamp_attention":
            return (f"clamp heads {list(self.heads)} at layer {self.layer} to key positions "
                    f"{list(self.key_positions)}")
        if self.kind == "steer":
            return (f"steer layer {self.layer} by {self.scale:g} x a vector of norm "
                    f"{float(np.linalg.norm(self.vector)):.3g} at {self.positions} positions")
        return f"capture resid_post of layer {self.layer}"

    def key(self) -> bytes:
        """Canonical bytes of what this edit does (the prefix-cache key hashes these)."""
        parts = [self.kind, str(self.layer), ",".join(map(str, self.heads)),
                 ",".join(map(str, self.experts)), repr(self.scale), self.positions,
                 ",".join(map(str, self.key_positions))]
        b = "|".join(parts).encode()
        if self.vector is not None:
            b += hashlib.sha256(self.vector.tobytes()).digest()
        return b

    def __repr__(self) -> str:
        return f"Intervention({self.describe()})"


def _layer(kind: str, layer) -> int:
    if not is_int(layer):
        raise ValueError(f"Intervention.{kind}: layer must be an integer (negative counts from "
                         f"the last layer), got {layer!r}")
    return int(layer)


@dataclass(frozen=True)
class ModelFacts:
    """What validation and the per-step tables need to know about the model."""
    num_layers: int
    num_heads: int              # attention (query) heads, all ranks together
    hidden_size: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    max_model_len: int = MAX_POSITION   # positions a request can hold: [0, max_model_len)

    @classmethod
    def of(cls, hf_config, moe_layers, max_model_len: int | None = None) -> "ModelFacts":
        return cls(hf_config.num_hidden_layers, hf_config.num_attention_heads,
                   hf_config.hidden_size, tuple(moe_layers),
                   getattr(hf_config, "num_experts", 0) or 0,
                   getattr(hf_config, "num_experts_per_tok", 0) or 0,
                   int(max_model_len) if max_model_len else MAX_POSITION)


def resolve_interventions(ivs, facts: ModelFacts, allow_internal: bool = False
                          ) -> tuple[Intervention, ...]:
    """A request's interventions checked against the model, layers made non-negative. None or
    [] -> (). An InvalidArgumentError says which entry is wrong and what is valid; its `param`
    names the field (`interventions[1].heads`)."""
    if ivs is None:
        return ()
    if isinstance(ivs, Intervention) or not isinstance(ivs, (list, tuple)):
        raise InvalidArgumentError(f"interventions must be a list of Intervention (e.g. "
                                   f"[Intervention.ablate_heads(1, [0])]), got "
                                   f"{type(ivs).__name__}", "interventions")
    if len(ivs) > MAX_INTERVENTIONS:
        raise InvalidArgumentError(f"{len(ivs)} interventions given; at most "
                                   f"{MAX_INTERVENTIONS} per request", "interventions")
    L, out = facts.num_layers, []
    masked: dict[int, set[int]] = {}
    clamped: dict[int, tuple[int, ...]] = {}    # layer -> its clamp's key positions
    for i, iv in enumerate(ivs):
        where = f"interventions[{i}]"

        def bad(field: str, why: str):
            return InvalidArgumentError(f"{where} ({iv.kind}): {why}", f"{where}.{field}")
        if not isinstance(iv, Intervention):
            raise InvalidArgumentError(f"{where} must be an Intervention "
                                       "(Intervention.ablate_heads / .mask_experts / .steer / "
                                       f".clamp_attention), got {type(iv).__name__}", where)
        if iv.kind not in KINDS and not (iv.kind == CAPTURE and allow_internal):
            raise InvalidArgumentError(f"{where}: unknown kind {iv.kind!r}; build interventions "
                                       "with Intervention.ablate_heads / .mask_experts / .steer "
                                       "/ .clamp_attention", f"{where}.kind")
        if not -L <= iv.layer < L:
            raise bad("layer", f"layer {iv.layer} is out of range for this model's {L} layers; "
                               f"valid indices are [-{L}, {L})")
        layer = iv.layer % L
        if iv.kind in ("ablate_heads", "clamp_attention"):
            wrong = [h for h in iv.heads if not 0 <= h < facts.num_heads]
            if wrong:
                raise bad("heads", f"heads {wrong} are out of range; this model has "
                                   f"{facts.num_heads} attention heads per layer, valid ids are "
                                   f"[0, {facts.num_heads})")
        elif iv.kind == "mask_experts":
            if layer not in facts.moe_layers:
                what = (f"its MoE layers are {list(facts.moe_layers)}" if facts.moe_layers
                        else "it is a dense model")
                raise bad("experts", f"layer {layer} has no experts (not a MoE layer); {what}")
            wrong = [e for e in iv.experts if not 0 <= e < facts.num_experts]
            if wrong:
                raise bad("experts", f"experts {wrong} are out of range; valid ids are "
                                     f"[0, {facts.num_experts})")
            m = masked.setdefault(layer, set())
            m.update(iv.experts)
            if facts.num_experts - len(m) < facts.top_k:
                raise bad("experts", f"{len(m)} experts masked at layer {layer} leave "
                                     f"{facts.num_experts - len(m)}, fewer than the "
                                     f"{facts.top_k} each token routes to; mask at most "
                                     f"{facts.num_experts - facts.top_k}")
        if iv.kind == "clamp_attention":
            if iv.key_positions[-1] >= facts.max_model_len:
                raise bad("positions", f"position {iv.key_positions[-1]} is past this model's "
                                       f"max_model_len={facts.max_model_len}; positions are in "
                                       f"[0, {facts.max_model_len})")
            seen = clamped.setdefault(layer, iv.key_positions)
            if seen != iv.key_positions:
                raise bad("positions", f"layer {layer} is already clamped to positions "
                                       f"{list(seen)}; one request clamps a layer to one set of "
                                       "positions (list all its heads in one clamp)")
        elif iv.kind == "steer":
            if iv.vector.shape[0] != facts.hidden_size:
                raise bad("vector", f"vector has {iv.vector.shape[0]} entries, but the residual "
                                    f"stream has hidden_size={facts.hidden_size}")
            with np.errstate(over="ignore", invalid="ignore"):
                peak = float(np.abs(iv.vector * np.float32(iv.scale)).max())
            if not peak <= MAX_STEER:
                raise bad("scale", f"vector x scale reaches {peak:.3g}, past {MAX_STEER:g}: "
                                   "the residual stream would overflow (inf / NaN, an empty "
                                   "reply); use a smaller scale or vector")
        out.append(replace(iv, layer=layer))
    return tuple(out)


def cache_salt(ivs: tuple[Intervention, ...]) -> int | None:
    """The prefix-cache key's root for a request with these interventions (None: none).
    A stable 63-bit digest, so it never equals the chain's root of a plain request."""
    if not ivs:
        return None
    h = hashlib.blake2b(b"glassbox-interventions", digest_size=8)
    for iv in ivs:
        h.update(len(iv.key()).to_bytes(4, "little"))
        h.update(iv.key())
    return int.from_bytes(h.digest(), "little") >> 1


def per_prompt(interventions, n: int) -> list:
    """generate()'s argument -> one list per prompt: None, one list of Intervention for every
    prompt, or a list of n lists (None or [] for a prompt without any)."""
    if interventions is None:
        return [None] * n
    if isinstance(interventions, (list, tuple)) and interventions and all(
            x is None or isinstance(x, (list, tuple)) for x in interventions):
        if len(interventions) != n:
            raise ValueError(f"got {n} prompts but {len(interventions)} intervention lists; "
                             "give one list for all prompts, or one list per prompt")
        return list(interventions)
    return [interventions] * n

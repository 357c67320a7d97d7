"""Find interventions with a visible effect on a bundled demo checkpoint.

Searched on held-out prompts of the demo's trained tasks, each sent as the playground sends it
(with its system prompt), and shown on one example-button prompt whose reply changes:

  * ablate heads: the head the attention probe sees copying (it looks at the token a "Copy:"
    reply copies next), and the single head whose ablation breaks that task most;
  * mask experts (MoE only): the single expert whose masking breaks addition, and sorting, most;
  * steer: the first layer and scale at which "Reverse: c a t s" minus "Copy: c a t s" changes
    the reply to "Copy: d o g s".

The playground runs `search` once per checkpoint, off the request path, and lists what it finds
beside its What-if form (views/found_effects.py). From the shell it prints the same, plus the
attention probe's evidence for the copying head, so the README's examples can be re-checked:

    python tools/find_interventions.py [--model assets/demo-qwen3-moe] [--n 8] [--system ""]
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from engine import LLM, Intervention, ProbeSpec, SamplingParams  # noqa: E402
from demo_data import held_out_prompts  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=24)
DEMO_SYSTEM = "You are Glassbox, a tiny demo model."     # views/chat.py's, for the demos
# (task, the example-button prompt each effect is shown on)
SHOWN = {"copy": "Copy: glass box", "add": "What is 47+38?", "sort": "Sort: 42 7 19 3"}
STEER_A, STEER_B, STEER_ON = "Reverse: c a t s", "Copy: c a t s", "Copy: d o g s"


@dataclass
class Effect:
    """One intervention with a visible effect, as the What-if form takes it."""
    kind: str                   # the form's name: "ablate heads", "mask experts" or "steer"
    layer: int
    ids: str                    # heads or experts, "3"; "" for steer
    message: str                # the chat message it shows on
    before: str                 # the untouched reply to it
    after: str                  # the intervened reply
    evidence: str               # what the search measured
    prompt_a: str = ""
    prompt_b: str = ""
    scale: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _with_system(msgs: list[dict], system: str | None) -> list[dict]:
    users = [m for m in msgs if m["role"] != "system"]
    return ([{"role": "system", "content": system}] if system else []) + users


def _replies(llm, prompts, interventions=None) -> list[str]:
    outs = llm.generate(prompts, GREEDY, interventions=interventions)
    return [o.text.strip() for o in outs]


def _best_single(llm, task: str, system, n: int, make, candidates):
    """The candidate (layer, id) whose intervention leaves the fewest of `n` held-out prompts of
    `task` right, among those that change the shown prompt's reply; None when none does."""
    cases = held_out_prompts(task, n, seed=1)
    prompts = [_with_system(m, system) for m, _ in cases]
    prompts.append(_with_system([{"role": "user", "content": SHOWN[task]}], system))
    answers = [a for _, a in cases]
    base = _replies(llm, prompts)
    base_acc = np.mean([r == a for r, a in zip(base, answers)])
    best = None
    for layer, i in candidates:
        got = _replies(llm, prompts, [make(layer, [i])])
        acc = np.mean([r == a for r, a in zip(got, answers)])
        if got[-1] != base[-1] and (best is None or acc < best[0]):
            best = (acc, layer, i, got[-1])
    if best is None:
        return None
    acc, layer, i, after = best
    return (layer, i, SHOWN[task], base[-1], after,
            f"{task}: {base_acc:.0%} → {acc:.0%} right on {n} held-out prompts")


def head_effect(llm, system, n: int) -> Effect | None:
    cfg = llm.hf_config
    found = _best_single(llm, "copy", system, n, Intervention.ablate_heads,
                         [(layer, h) for layer in range(cfg.num_hidden_layers)
                          for h in range(cfg.num_attention_heads)])
    if found is None:
        return None
    layer, h, msg, before, after, ev = found
    return Effect("ablate heads", layer, str(h), msg, before, after, ev)


def expert_effects(llm, system, n: int) -> list[Effect]:
    out = []
    for task in ("add", "sort"):
        found = _best_single(llm, task, system, n, Intervention.mask_experts,
                             [(layer, e) for layer in llm.runner.moe_layers
                              for e in range(llm.hf_config.num_experts)])
        if found is not None:
            layer, e, msg, before, after, ev = found
            out.append(Effect("mask experts", layer, str(e), msg, before, after, ev))
    return out


def steer_effect(llm, system) -> Effect | None:
    """The smallest scale, then the earliest layer, at which the steer changes the reply (the
    vector is built from the two prompts alone, as the What-if form builds it)."""
    target = [_with_system([{"role": "user", "content": STEER_ON}], system)]
    plain = _replies(llm, target)[0]
    a, b = [{"role": "user", "content": STEER_A}], [{"role": "user", "content": STEER_B}]
    vectors = {layer: llm.steering_vector(layer, a, b)
               for layer in range(llm.hf_config.num_hidden_layers)}
    for scale in (1.0, 2.0, 4.0):
        for layer, v in vectors.items():
            got = _replies(llm, target, [Intervention.steer(layer, v, scale)])[0]
            if got != plain:
                return Effect("steer", layer, "", STEER_ON, plain, got,
                              f"steered along {STEER_A!r} − {STEER_B!r}, scale {scale:g}",
                              STEER_A, STEER_B, scale)
    return None


def search(llm, system: str | None = DEMO_SYSTEM, n: int = 8) -> list[Effect]:
    """Every effect found on this checkpoint: the copying head, the most damaging head, on MoE
    the experts, then the steer."""
    effects = [copying_head_effect(llm, system, n), head_effect(llm, system, n)]
    if llm.runner.moe_layers:
        effects += expert_effects(llm, system, n)
    effects.append(steer_effect(llm, system))
    return [e for e in effects if e is not None]


def copying_heads(llm, system, n: int) -> list[tuple[int, int, float]]:
    """The attention probe's evidence: (layer, head, mean attention) of the heads that, while a
    Copy reply streams, look most at the very prompt token the reply copies next (reply token k
    comes from prompt position start + k); the top three, or none when the reply is no copy."""
    msgs, _ = held_out_prompts("copy", n, seed=1)[0]
    out = llm.generate([_with_system(msgs, system)], GREEDY,
                       watch=ProbeSpec(logit_lens=False, norms=False))[0]
    tr = llm.trace(out.request_id)
    prompt, reply = out.prompt_token_ids, out.token_ids
    P, m = len(prompt), len(reply) - 1          # the last reply token is the end of turn
    # the reply's first word has no leading space and may split into other tokens than its copy
    # in the prompt: align the longest tail of the reply that is a span of the prompt
    start = first = None
    for j in range(m - 1):
        k = m - j
        i = next((i for i in range(P - k + 1) if prompt[i:i + k] == reply[j:m]), None)
        if i is not None:
            start, first = i - j, j
            break
    if start is None:
        return []
    L, H = llm.hf_config.num_hidden_layers, llm.hf_config.num_attention_heads
    mass, steps = np.zeros((L, H)), 0
    for st in tr.attention:
        k = st.position + 1 - P          # this query predicts reply token k
        if first <= k < m:
            for j, layer in enumerate(st.layers):
                mass[layer] += st.probs[j][:, start + k]
            steps += 1
    mass /= max(1, steps)
    order = np.argsort(mass.ravel())[::-1][:3]
    return [(int(i // H), int(i % H), float(mass.ravel()[i])) for i in order]


def copying_head_effect(llm, system, n: int) -> Effect | None:
    """Ablating the head the attention probe sees copying, when that changes the shown reply."""
    heads = copying_heads(llm, system, n)
    if not heads:
        return None
    layer, head, mass = heads[0]
    shown = [_with_system([{"role": "user", "content": SHOWN["copy"]}], system)]
    before = _replies(llm, shown)[0]
    after = _replies(llm, shown, [Intervention.ablate_heads(layer, [head])])[0]
    if after == before:
        return None
    return Effect("ablate heads", layer, str(head), SHOWN["copy"], before, after,
                  f"the attention probe sees it put {mass:.0%} of its attention on the token "
                  "a Copy reply copies next")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "assets/demo-qwen3"))
    ap.add_argument("--n", type=int, default=8, help="held-out prompts per task")
    ap.add_argument("--system", default=DEMO_SYSTEM,
                    help="the system prompt sent with every prompt ('' for none)")
    args = ap.parse_args()
    with LLM(args.model, device="cpu") as llm:
        print(f"== {os.path.basename(args.model)}, system prompt {args.system!r} ==")
        for e in search(llm, args.system or None, args.n):
            what = f"{e.kind} {e.ids} at layer {e.layer}" if e.ids else \
                f"{e.kind} at layer {e.layer}"
            print(f"  {what}: {e.message!r}: {e.before!r} -> {e.after!r}   ({e.evidence})")
        heads = copying_heads(llm, args.system or None, args.n)
        print("  attention probe, mean attention on the token a Copy reply copies next: "
              + (", ".join(f"layer {la} head {h}: {m:.0%}" for la, h, m in heads) or "none"))


if __name__ == "__main__":
    main()

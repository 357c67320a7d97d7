"""Find interventions with a visible effect on the bundled demo checkpoints, and print them
with the evidence, so the README's examples can be re-checked:

  * ablate_heads (demo-qwen3): which single head, ablated, breaks the "Copy:" task most — and
    which head the attention probe shows looking at the words being copied;
  * mask_experts (demo-qwen3-moe): which single expert, masked, breaks a task most;
  * steer (demo-qwen3): a "Reverse:" minus "Copy:" vector, added to a Copy prompt.

    python tools/find_interventions.py [--n 12]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from engine import LLM, Intervention, ProbeSpec, SamplingParams  # noqa: E402
from demo_data import held_out_prompts  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def accuracy(llm, cases, interventions=None) -> tuple[float, list[str]]:
    outs = llm.generate([m for m, _ in cases], GREEDY, interventions=interventions)
    replies = [o.text.strip() for o in outs]
    return float(np.mean([r == a for r, (_, a) in zip(replies, cases)])), replies


def copy_heads(llm, n: int) -> None:
    cases = held_out_prompts("copy", n, seed=1)
    base, replies = accuracy(llm, cases)
    print(f"\n== demo-qwen3: ablate one head, Copy task ({n} held-out prompts) ==")
    print(f"no intervention: {base:.0%} right   e.g. {cases[0][0][-1]['content']!r} -> {replies[0]!r}")
    L, H = llm.hf_config.num_hidden_layers, llm.hf_config.num_attention_heads
    scores = {}
    for layer in range(L):
        for head in range(H):
            acc, rep = accuracy(llm, cases, [Intervention.ablate_heads(layer, [head])])
            scores[layer, head] = (acc, rep[0])
    for (layer, head), (acc, r0) in sorted(scores.items(), key=lambda kv: kv[1][0])[:4]:
        print(f"  ablate layer {layer} head {head}: {acc:.0%} right   e.g. -> {r0!r}")
    # the attention probe: which head, while the reply streams, looks at the very prompt token
    # that the reply copies next (reply token k comes from prompt position start + k)
    msgs, answer = cases[0]
    out = llm.generate([msgs], GREEDY, watch=ProbeSpec(logit_lens=False, norms=False))[0]
    tr = llm.trace(out.request_id)
    prompt, reply = out.prompt_token_ids, out.token_ids
    P = len(prompt)
    m = len(reply) - 1                   # the last reply token is the end of turn
    # the reply's first word has no leading space and may split into other tokens than its copy
    # in the prompt: align the longest tail of the reply that is a span of the prompt
    start = first = None
    for j in range(m - 1):
        n = m - j
        i = next((i for i in range(P - n + 1) if prompt[i:i + n] == reply[j:m]), None)
        if i is not None:
            start, first = i - j, j
            break
    if start is None:
        print("  attention probe: the reply's tokens are not a span of the prompt; skipped")
        return
    mass, steps = np.zeros((L, H)), 0
    for st in tr.attention:
        k = st.position + 1 - P          # this query predicts reply token k
        if first <= k < m:
            for j, layer in enumerate(st.layers):
                mass[layer] += st.probs[j][:, start + k]
            steps += 1
    mass /= max(1, steps)
    order = np.argsort(mass.ravel())[::-1][:3]
    best = ", ".join(f"layer {i // H} head {i % H}: {mass.ravel()[i]:.0%}" for i in order)
    print(f"  attention probe, mass on the token copied next (mean over {steps} reply tokens): "
          f"{best}")


def experts(llm, n: int) -> None:
    print(f"\n== demo-qwen3-moe: mask one expert ({n} held-out prompts per task) ==")
    L, E = llm.hf_config.num_hidden_layers, llm.hf_config.num_experts
    for task in ("add", "sort", "copy"):
        cases = held_out_prompts(task, n, seed=2)
        base, replies = accuracy(llm, cases)
        res = []
        for layer in llm.runner.moe_layers:
            for e in range(E):
                acc, rep = accuracy(llm, cases, [Intervention.mask_experts(layer, [e])])
                res.append((acc, layer, e, rep[0]))
        res.sort()
        acc, layer, e, r0 = res[0]
        print(f"  {task}: {base:.0%} right; masking layer {layer} expert {e}: {acc:.0%}   "
              f"e.g. {cases[0][0][-1]['content']!r}: {replies[0]!r} -> {r0!r}")


def steering(llm) -> None:
    print("\n== demo-qwen3: steer a Copy prompt with (Reverse - Copy) ==")
    a = [{"role": "user", "content": "Reverse: c a t s"}]
    b = [{"role": "user", "content": "Copy: c a t s"}]
    target = [{"role": "user", "content": "Copy: d o g s"}]
    plain = llm.generate([target], GREEDY)[0].text
    print(f"  'Copy: d o g s' -> {plain!r}")
    for layer in range(llm.hf_config.num_hidden_layers):
        v = llm.steering_vector(layer, a, b)
        row = []
        for scale in (1.0, 2.0, 4.0, 8.0):
            r = llm.generate([target], GREEDY,
                             interventions=[Intervention.steer(layer, v, scale)])[0].text
            row.append(f"x{scale:g}: {r!r}")
        print(f"  layer {layer} (|v| = {v.norm():.1f}): " + "   ".join(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=12, help="held-out prompts per task")
    ap.add_argument("--only", choices=("heads", "steer", "experts"), default=None)
    args = ap.parse_args()
    if args.only in (None, "heads", "steer"):
        with LLM(os.path.join(ROOT, "assets/demo-qwen3"), device="cpu") as llm:
            if args.only in (None, "heads"):
                copy_heads(llm, args.n)
            if args.only in (None, "steer"):
                steering(llm)
    if args.only in (None, "experts"):
        with LLM(os.path.join(ROOT, "assets/demo-qwen3-moe"), device="cpu") as llm:
            experts(llm, args.n)


if __name__ == "__main__":
    main()

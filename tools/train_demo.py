"""Trains the bundled demo checkpoints (a small dense Qwen3 and a small Qwen3-MoE) from scratch.

Glassbox's default model must run offline and visibly do something, so this script builds its
own byte-level BPE tokenizer, trains both models on synthetic chat tasks (tools/demo_data.py)
mixed with Python-documentation prose (tools/prose.txt.gz), saves HF-format checkpoint dirs and
measures them with HF generate on held-out prompts:

    python tools/train_demo.py --out assets              # one H200: about 5 minutes for both
    python tools/train_demo.py --out /tmp/demo --quick   # CPU smoke run (untrained output)

Writes <out>/demo-qwen3/ and <out>/demo-qwen3-moe/, each with config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json and train_report.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_data as dd  # noqa: E402

VOCAB_SIZE = 4096
MAX_POSITIONS = 512
PROSE_LEN = 256  # tokens per prose training row
TASK_BUCKETS = 4  # length buckets of the task pool
TASK_MIX = {"add": 0.3, "copy": 0.15, "reverse": 0.2, "count": 0.15, "sort": 0.2}
# Qwen's pre-tokenizer pattern: \p{N} alone makes every digit its own token, so arithmetic
# is learnable digit by digit.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
EOT_ID, IM_START_ID, IM_END_ID = 0, 1, 2


# ---- tokenizer ----------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (Qwen-style split), specials <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(dd.SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    assert [tok.token_to_id(t) for t in dd.SPECIAL_TOKENS] == [EOT_ID, IM_START_ID, IM_END_ID]
    return tok


def save_tokenizer(tok, out: Path) -> None:
    """tokenizer.json + a tokenizer_config.json that carries the chat template (Qwen hub layout)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": dd.IM_END,
        "pad_token": dd.EOT,
        "unk_token": None,
        "additional_special_tokens": list(dd.SPECIAL_TOKENS),
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": dd.CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ---- data ---------------------------------------------------------------------------------

def _pad_rows(rows: list[list[int]], labels: list[list[int]], length: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    import numpy as np
    ids = np.full((len(rows), length), EOT_ID, dtype=np.int64)
    lab = np.full((len(rows), length), -100, dtype=np.int64)
    for i, (r, l) in enumerate(zip(rows, labels)):
        n = min(len(r), length)
        ids[i, :n] = r[:n]
        lab[i, :n] = l[:n]
    return torch.from_numpy(ids), torch.from_numpy(lab)  # [N, length] each; label -100 = no loss


def _pieces(msgs: dd.Messages, answer: str) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_labelled) pieces: every assistant turn's text and
    its <|im_end|> is labelled, the template and the other turns are not."""
    out = []
    for m in msgs:
        if m["role"] == "assistant":
            out += [(f"{dd.IM_START}assistant\n", False), (m["content"] + dd.IM_END, True),
                    ("\n", False)]
        else:
            out.append((f"{dd.IM_START}{m['role']}\n{m['content']}{dd.IM_END}\n", False))
    return out + [(f"{dd.IM_START}assistant\n", False), (answer + dd.IM_END, True)]


def encode_chats(tok, examples: list[tuple[dd.Messages, str]], length: int | None,
                 check: int = 2000) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenizes conversations (messages, final answer); loss on every assistant turn's text and
    its <|im_end|>, nothing else. Pieces are tokenized apart (each starts at a special token or
    right after "assistant\n", both pre-token boundaries); the first `check` rows are compared
    with tokenizing the whole text, so generation sees exactly the tokens training saw."""
    convs = [_pieces(m, a) for m, a in examples]
    uniq = list({t for c in convs for t, _ in c})
    ids_of = dict(zip(uniq, (e.ids for e in tok.encode_batch(uniq, add_special_tokens=False))))
    rows, labels = [], []
    for c in convs:
        r, lab = [], []
        for text, labelled in c:
            ids = ids_of[text]
            r += ids
            lab += ids if labelled else [-100] * len(ids)
        rows.append(r)
        labels.append(lab)
    whole = tok.encode_batch(["".join(t for t, _ in c) for c in convs[:check]],
                             add_special_tokens=False)
    assert all(e.ids == r for e, r in zip(whole, rows)), "pieces tokenize unlike the whole text"
    length = length or max(len(r) for r in rows)
    return _pad_rows(rows, labels, length)


def _last_turn_only(lab: torch.Tensor) -> torch.Tensor:
    """Keeps the labels of each row's last labelled run (its final assistant answer)."""
    out = lab.clone()
    for r in range(lab.shape[0]):
        idx = (lab[r] != -100).nonzero().flatten().tolist()
        start = idx[-1]
        while start - 1 in idx:
            start -= 1
        out[r, :start] = -100
    return out


class Batches:
    """Device-resident pools; each step samples a task micro-batch and a prose micro-batch."""

    def __init__(self, tok, sections, n_task: int, n_chat: int, rng: random.Random,
                 device: torch.device, gen: torch.Generator):
        tasks = random.Random(rng.random()).choices(list(TASK_MIX), list(TASK_MIX.values()),
                                                    k=n_task)
        task_ex = [dd.training_conversation(t, rng, sections) for t in tasks]
        # Conversations of 1-3 turns differ ~4x in length: sorted into length buckets, each
        # padded to its own longest row, so a step pays for its own rows' length only.
        task_ids, task_lab = encode_chats(tok, task_ex, None)
        lengths = (task_ids != EOT_ID).sum(1)
        order = lengths.argsort()
        self.buckets = []
        for part in order.chunk(TASK_BUCKETS):
            width = int(lengths[part].max())
            self.buckets.append((task_ids[part, :width].to(device),
                                 task_lab[part, :width].to(device)))
        self.bucket_rng = random.Random(rng.random())
        chat_ex = [dd.prose_chat_example(sections, rng) for _ in range(n_chat)]
        self.chat_ids, self.chat_lab = (x.to(device)
                                        for x in encode_chats(tok, chat_ex, PROSE_LEN))
        docs = dd.prose_documents(sections)
        stream: list[int] = []
        for e in tok.encode_batch(docs, add_special_tokens=False):
            stream += e.ids + [EOT_ID]
        self.stream = torch.tensor(stream, dtype=torch.long, device=device)  # [prose tokens]
        self.device, self.gen = device, gen
        # Held-out turns for a cheap in-training check (teacher-forced exact match), alone and
        # as the third turn of a conversation ("add@3").
        self.held_out = {}
        for t in dd.TASKS:
            for turns in (1, 3):
                convs = dd.held_out_conversations(t, 256, turns, seed=7)
                ids, lab = encode_chats(tok, convs, None)
                if turns > 1:   # grade the last answer only
                    lab = _last_turn_only(lab)
                self.held_out[t if turns == 1 else f"{t}@{turns}"] = (ids.to(device),
                                                                       lab.to(device))
        self.stats = {"task_pool": int(task_ids.shape[0]),
                      "task_len": int(task_ids.shape[1]),
                      "task_bucket_lens": [int(b[0].shape[1]) for b in self.buckets],
                      "prose_chat_pool": int(self.chat_ids.shape[0]),
                      "prose_stream_tokens": len(stream)}

    def _pick(self, n: int, high: int) -> torch.Tensor:
        return torch.randint(0, high, (n,), device=self.device, generator=self.gen)

    def task(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, lab = self.bucket_rng.choice(self.buckets)   # equal-sized buckets: uniform
        i = self._pick(n, ids.shape[0])
        return ids[i], lab[i]

    def prose(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Half chat turns about the docs, half raw windows of the docs (loss on every token)."""
        n_chat = n // 2
        i = self._pick(n_chat, self.chat_ids.shape[0])
        starts = self._pick(n - n_chat, self.stream.numel() - PROSE_LEN)
        raw = self.stream[starts[:, None] + torch.arange(PROSE_LEN, device=self.device)]
        ids = torch.cat([self.chat_ids[i], raw])
        return ids, torch.cat([self.chat_lab[i], raw])  # [n, PROSE_LEN] each


# ---- models -------------------------------------------------------------------------------

def model_config(kind: str):
    from transformers import Qwen3Config, Qwen3MoeConfig
    trunk = dict(vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=352, max_position_embeddings=MAX_POSITIONS,
                 rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 bos_token_id=None, eos_token_id=IM_END_ID, pad_token_id=EOT_ID,
                 attention_dropout=0.0, initializer_range=0.02)
    if kind == "dense":
        return Qwen3Config(**trunk)
    return Qwen3MoeConfig(**trunk, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], router_aux_loss_coef=0.01,
                          output_router_logits=False)


def _all_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Training-only Qwen3MoeExperts.forward: every expert on every token, weighted by routing.

    Same maths as HF's sparse loop (non-selected experts get weight 0) but with no host syncs and
    plain einsums that bf16 autocast handles; 8 small experts make the extra FLOPs cheap.
    """
    # hidden_states [T, H]; top_k_index/top_k_weights [T, k]
    n_exp = self.gate_up_proj.shape[0]
    weights = torch.zeros(hidden_states.shape[0], n_exp, device=hidden_states.device,
                          dtype=top_k_weights.dtype).scatter(1, top_k_index, top_k_weights)
    gate_up = torch.einsum("th,eoh->eto", hidden_states, self.gate_up_proj)  # [E, T, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.einsum("eti,ehi->eth", self.act_fn(gate) * up, self.down_proj)  # [E, T, H]
    return (out * weights.t().unsqueeze(-1).to(out.dtype)).sum(0).to(hidden_states.dtype)


def build_model(kind: str, device: torch.device):
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM
    cfg = model_config(kind)
    cfg._attn_implementation = "sdpa"
    model = (Qwen3ForCausalLM if kind == "dense" else Qwen3MoeForCausalLM)(cfg)
    for m in model.modules():
        if type(m).__name__ == "Qwen3MoeExperts":
            m.forward = types.MethodType(_all_experts_forward, m)
    return model.to(device)


@torch.no_grad()
def teacher_forced_accuracy(model, batches: Batches, autocast) -> dict[str, float]:
    """Share of held-out turns whose every answer token (and <|im_end|>) is the argmax: exactly
    the turns greedy decoding would get right, at the cost of one forward per task."""
    model.eval()
    acc = {}
    for task, (ids, lab) in batches.held_out.items():
        with autocast:
            logits = model(input_ids=ids).logits  # [N, T, V]
        pred, target = logits[:, :-1].argmax(-1), lab[:, 1:]
        ok = ((pred == target) | (target == -100)).all(dim=1)
        acc[task] = round(ok.float().mean().item(), 4)
    model.train()
    return acc


# ---- training -----------------------------------------------------------------------------

def lr_at(progress: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    if progress < warmup:
        return peak * progress / warmup
    t = (progress - warmup) / (1 - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def train(model, batches: Batches, args, kind: str, device: torch.device) -> dict:
    """Runs until --steps or the time budget, whichever comes first; the LR schedule follows
    whichever is further along, so a slow machine still ends with a decayed learning rate."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    budget = args.time_budget * (1.0 if kind == "dense" else args.moe_time_factor)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    is_moe = kind == "moe"
    curve, probes, step, t0 = [], [], 0, time.time()
    model.train()
    while True:
        progress = max(step / args.steps, (time.time() - t0) / budget)
        if progress >= 1.0:
            break
        lr = lr_at(progress, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        losses = []
        for ids, lab in (batches.task(args.task_batch), batches.prose(args.prose_batch)):
            with autocast:
                # For the MoE, HF adds router_aux_loss_coef x the load-balancing loss to out.loss.
                out = model(input_ids=ids, labels=lab, output_router_logits=is_moe)
            out.loss.backward()
            ce = out.loss.detach()
            if is_moe:
                ce = ce - model.config.router_aux_loss_coef * out.aux_loss.detach()
            losses.append(ce)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % args.log_every == 0 or step == 1:
            lt, lp = (x.item() for x in losses)
            el = time.time() - t0
            curve.append({"step": step, "time_s": round(el, 1), "lr": lr,
                          "loss_task": round(lt, 4), "loss_prose": round(lp, 4)})
            print(f"[{kind}] step {step:5d}  t={el:6.1f}s  lr={lr:.2e}  "
                  f"loss task {lt:.3f}  prose {lp:.3f}", flush=True)
        if step % args.probe_every == 0:
            acc = teacher_forced_accuracy(model, batches, autocast)
            probes.append({"step": step, "time_s": round(time.time() - t0, 1), **acc})
            print(f"[{kind}] step {step:5d}  held-out teacher-forced {acc}", flush=True)
    final = teacher_forced_accuracy(model, batches, autocast)
    probes.append({"step": step, "time_s": round(time.time() - t0, 1), **final})
    print(f"[{kind}] final held-out teacher-forced {final}", flush=True)
    return {"steps": step, "train_time_s": round(time.time() - t0, 1), "curve": curve,
            "held_out_teacher_forced": probes}


# ---- saving -------------------------------------------------------------------------------

def save_checkpoint(model, tok, kind: str, out: Path) -> None:
    from transformers import GenerationConfig
    dtype = torch.float32 if kind == "dense" else torch.bfloat16
    model = model.to(dtype).eval()
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=[IM_END_ID, EOT_ID],
                                               pad_token_id=EOT_ID, do_sample=False)
    model.save_pretrained(str(out))
    save_tokenizer(tok, out)
    # Real Qwen hub configs spell these the older way; keep both so any reader finds them.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    if kind == "moe":
        cfg["num_experts"] = cfg.get("num_local_experts", cfg.get("num_experts"))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ---- evaluation ---------------------------------------------------------------------------

def load_for_eval(path: Path, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    kw = {"experts_implementation": "eager"} if "moe" in path.name else {}
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw)
    return model.to(device).eval(), tok


@torch.no_grad()
def generate(model, tok, convs: list[dd.Messages], max_new_tokens: int, batch: int = 256,
             sampling: dict | None = None) -> list[str]:
    """Greedy HF generate on chat-formatted prompts; returns the decoded replies."""
    replies = []
    for i in range(0, len(convs), batch):
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                 for m in convs[i: i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True).to(model.device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens,
                             **(sampling or {"do_sample": False}))
        new = out[:, enc["input_ids"].shape[1]:]
        replies += tok.batch_decode(new, skip_special_tokens=True)
    return replies


def evaluate(path: Path, device: torch.device, n: int, sections, free_tokens: int = 80) -> dict:
    model, tok = load_for_eval(path, device)
    acc, samples = {}, {}
    for task in dd.TASKS:
        pairs = dd.held_out_prompts(task, n, seed=0)
        got = generate(model, tok, [m for m, _ in pairs], max_new_tokens=24)
        ok = [dd.check_answer(task, g, e) for g, (_, e) in zip(got, pairs)]
        acc[task] = round(sum(ok) / len(ok), 4)
        samples[task] = [{"prompt": m[-1]["content"], "expected": e, "got": g.strip()}
                         for (m, e), g in list(zip(pairs, got))[:3]]
    free = dd.free_prompts(5, seed=0, sections=sections)
    free_out = generate(model, tok, free, max_new_tokens=free_tokens)
    torch.manual_seed(0)
    sampled = generate(model, tok, free, max_new_tokens=free_tokens,
                       sampling={"do_sample": True, "temperature": 0.7, "top_k": 40})
    by_turn = {"1": acc}
    for turns in (2, 3):
        by_turn[str(turns)] = {}
        for task in dd.TASKS:
            pairs = dd.held_out_conversations(task, n, turns, seed=0)
            got = generate(model, tok, [m for m, _ in pairs], max_new_tokens=24)
            ok = [dd.check_answer(task, g, e) for g, (_, e) in zip(got, pairs)]
            by_turn[str(turns)][task] = round(sum(ok) / len(ok), 4)
    newcomer = generate(model, tok, [[{"role": "user", "content": q}]
                                     for q, _ in dd.NEWCOMER_PROMPTS], max_new_tokens=24)
    report = {"accuracy": acc,
              "accuracy_by_turn": by_turn,
              "newcomer_prompts": [{"prompt": q, "expected": e, "got": g.strip(),
                                    "ok": dd.check_answer("copy", g, e)}
                                   for (q, e), g in zip(dd.NEWCOMER_PROMPTS, newcomer)],
              "graded_accuracy": round(sum(acc[t] for t in dd.GRADED_TASKS)
                                       / len(dd.GRADED_TASKS), 4),
              "samples": samples,
              "free_samples": [{"prompt": m[-1]["content"], "reply": r.strip()}
                               for m, r in zip(free, free_out)],
              "free_samples_sampled": {"settings": "temperature 0.7, top_k 40, torch seed 0",
                                       "samples": [{"prompt": m[-1]["content"], "reply": r.strip()}
                                                   for m, r in zip(free, sampled)]}}
    if "moe" in path.name:
        report["expert_load"] = expert_load(model, path, n, sections)
    return report


@torch.no_grad()
def expert_load(model, path: Path, n: int, sections) -> dict:
    """Fraction of top-k routing slots each expert gets, per task and layer, on held-out turns.

    'answer' counts only the reply tokens (what the model generates); 'all' every token of the
    conversation (template tokens included, which all tasks share)."""
    from tokenizers import Tokenizer
    # A fresh tokenizer: HF may have left padding switched on in its backend during generate.
    raw_tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    k, n_exp = model.config.num_experts_per_tok, model.config.num_experts
    rng = random.Random(1)
    groups = {t: dd.held_out_prompts(t, n, seed=1) for t in dd.TASKS}
    groups["prose"] = [dd.prose_chat_example(sections, rng) for _ in range(n)]
    result = {}
    for name, pairs in groups.items():
        ids, lab = encode_chats(raw_tok, pairs, None)
        ids, lab = ids.to(model.device), lab.to(model.device)
        out = model(input_ids=ids, output_router_logits=True)
        real = (ids != EOT_ID).reshape(-1)  # pad id; EOT never appears inside a chat turn
        answer = (lab != -100).reshape(-1)
        per = {"all": [], "answer": []}
        for logits in out.router_logits:  # per layer: [B*T, E]
            top = logits.float().topk(k, dim=-1).indices  # [B*T, k]
            for key, mask in (("all", real), ("answer", answer)):
                counts = torch.bincount(top[mask].reshape(-1), minlength=n_exp).float()
                per[key].append([round(x, 4) for x in (counts / counts.sum()).tolist()])
        result[name] = per
    return result


# ---- main ---------------------------------------------------------------------------------

def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("assets"))
    ap.add_argument("--steps", type=int, default=None, help="max optimizer steps per model")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="training seconds for the dense model (MoE gets --moe-time-factor x)")
    ap.add_argument("--moe-time-factor", type=float, default=1.2)
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    ap.add_argument("--only", choices=("dense", "moe"), default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="reuse this tokenizer.json instead of training one")
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    q = args.quick
    args.steps = args.steps or (10 if q else 6000)
    args.time_budget = args.time_budget or (60.0 if q else 125.0)
    args.task_batch, args.prose_batch = (16, 4) if q else (512, 64)
    args.log_every = 5 if q else 100
    args.probe_every = 5 if q else 500
    n_eval = 4 if q else 200
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    t_start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    sections = dd.load_prose()
    if q:
        sections = sections[:300]
    rng = random.Random(args.seed)
    tok_texts = dd.prose_documents(sections)
    tok_texts += [dd.render_chat(m) + a + dd.IM_END for m, a in
                  (dd.task_example(t, rng) for t in dd.TASKS for _ in range(2000))]
    if args.tokenizer is not None:      # keep the shipped token ids (tests and docs name some)
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(args.tokenizer))
        assert [tok.token_to_id(t) for t in dd.SPECIAL_TOKENS] == [EOT_ID, IM_START_ID, IM_END_ID]
    else:
        tok = train_tokenizer(tok_texts, VOCAB_SIZE)
    print(f"tokenizer: {tok.get_vocab_size()} tokens ({time.time() - t_start:.1f}s)", flush=True)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    batches = Batches(tok, sections, n_task=4000 if q else 250_000,
                      n_chat=400 if q else 40_000, rng=rng, device=device, gen=gen)
    print(f"data: {batches.stats} ({time.time() - t_start:.1f}s)", flush=True)

    kinds = [args.only] if args.only else ["dense", "moe"]
    for kind in kinds:
        name = "demo-qwen3" if kind == "dense" else "demo-qwen3-moe"
        out = args.out / name
        torch.manual_seed(args.seed)
        model = build_model(kind, device)
        n_params = param_count(model)
        print(f"[{kind}] {n_params / 1e6:.2f}M parameters", flush=True)
        stats = train(model, batches, args, kind, device)
        save_checkpoint(model, tok, kind, out)
        del model
        t_eval = time.time()
        report = evaluate(out, device, n_eval, sections, free_tokens=16 if q else 80)
        report.update({
            "model": name, "kind": kind, "parameters": n_params,
            "dtype_on_disk": "float32" if kind == "dense" else "bfloat16",
            "size_bytes": {f.name: f.stat().st_size for f in sorted(out.iterdir())},
            "train": stats, "eval_time_s": round(time.time() - t_eval, 1),
            "eval_prompts_per_task": n_eval,
            "data": batches.stats, "seed": args.seed, "quick": q, "device": str(device),
            "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "batch": {"task_rows": args.task_batch, "prose_rows": args.prose_batch,
                      "prose_len": PROSE_LEN},
            "versions": {"torch": torch.__version__,
                         "transformers": __import__("transformers").__version__,
                         "tokenizers": __import__("tokenizers").__version__},
            "command": " ".join(sys.argv),
        })
        (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"[{kind}] accuracy by turn {report['accuracy_by_turn']}  "
              f"eval {report['eval_time_s']}s", flush=True)
        print(f"[{kind}] newcomer prompts: " + "; ".join(
            f"{r['prompt']} -> {r['got']!r}" for r in report["newcomer_prompts"]), flush=True)
        for s in report["free_samples"][:3]:
            print(f"[{kind}] {s['prompt']!r} -> {s['reply'][:200]!r}", flush=True)
    print(f"total {time.time() - t_start:.1f}s", flush=True)


if __name__ == "__main__":
    main()

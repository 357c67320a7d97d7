"""The bundled demo checkpoints load in HF transformers and answer held-out task prompts."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import demo_data as dd  # noqa: E402

DENSE = ROOT / "assets" / "demo-qwen3"
MOE = ROOT / "assets" / "demo-qwen3-moe"
CKPT_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json")
MB = 1_000_000


def _need(path: Path) -> None:
    if not (path / "model.safetensors").exists():
        pytest.skip(f"{path.relative_to(ROOT)} not built yet: run tools/train_demo.py on a GPU "
                    "and copy its output into assets/")


@pytest.fixture(scope="module")
def dense():
    _need(DENSE)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(DENSE))
    model = AutoModelForCausalLM.from_pretrained(str(DENSE), dtype=torch.float32).eval()
    return model, tok


def _generate(model, tok, convs: list[dd.Messages], max_new_tokens: int) -> list[str]:
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in convs]
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


# ---- the data module (no checkpoint needed) -----------------------------------------------

def test_held_out_prompts_are_outside_the_training_split():
    rng = random.Random(123)
    for task in dd.TASKS:
        held = dd.held_out_prompts(task, 30, seed=3)
        assert held == dd.held_out_prompts(task, 30, seed=3)  # deterministic
        train = (dd.task_example(task, rng) for _ in range(300))
        train_users = {m[-1]["content"] for m, _ in train}
        assert not train_users & {m[-1]["content"] for m, _ in held}


def _task_and_key(user: str) -> tuple[str, str]:
    """Read a task prompt back into (task, the input its held-out split is decided on)."""
    import re
    if m := re.fullmatch(r"(?:What is |Add )?(\d+)(?: ?\+ ?| and )(\d+)(?:\?|\.|=\?)", user):
        return "add", f"{m[1]}+{m[2]}"
    for task, heads in (("copy", ("Copy: ", "Repeat after me: ")),
                        ("reverse", ("Reverse: ", "Write backwards: ")),
                        ("count", ("Count the words: ", "How many words? ")),
                        ("sort", ("Sort: ", "Sort these numbers: "))):
        for h in heads:
            if user.startswith(h):
                return task, user[len(h):]
    raise AssertionError(f"not a task prompt: {user!r}")


def test_conversations_train_on_the_training_split_and_grade_on_the_held_out_one():
    """Earlier turns (training and held-out conversations alike) come from the training split
    with their right answers; a held-out conversation's last turn is held out, a training one's
    is not."""
    sections = dd.load_prose()
    rng = random.Random(7)
    for task in dd.TASKS:
        held = dd.held_out_conversations(task, 20, 3, seed=2)
        train = [dd.training_conversation(task, rng, sections) for _ in range(60)]
        assert any(len(m) > 2 for m, _ in train) and any(len(m) <= 2 for m, _ in train)
        for convs, last_held in ((held, True), (train, False)):
            for msgs, answer in convs:
                turns = [m for m in msgs if m["role"] != "system"]
                t, key = _task_and_key(turns[-1]["content"])
                assert t == task and dd.is_held_out(t, key) == last_held
                for user, reply in zip(turns[:-1:2], turns[1:-1:2]):
                    assert user["role"] == "user" and reply["role"] == "assistant"
                    if user["content"].startswith(("Tell me about", "Continue: ")):
                        continue        # a prose turn
                    t, key = _task_and_key(user["content"])
                    assert not dd.is_held_out(t, key)
                    assert dd.check_answer(t, reply["content"], _answer(t, key))


def _answer(task: str, key: str) -> str:
    """The right answer, computed here independently of demo_data."""
    if task == "add":
        a, b = key.split("+")
        return str(int(a) + int(b))
    words = key.split()
    if task == "sort":
        return " ".join(map(str, sorted(map(int, words))))
    return {"copy": key, "reverse": " ".join(reversed(words)), "count": str(len(words))}[task]


def test_check_answer_ignores_whitespace_and_end_tokens_only():
    assert dd.check_answer("add", " 85<|im_end|>\n", "85")
    assert dd.check_answer("copy", "red  fox", "red fox")
    assert not dd.check_answer("add", "58", "85")
    assert not dd.check_answer("reverse", "a b c d", "a b c")
    with pytest.raises(ValueError):
        dd.check_answer("nope", "1", "1")


# ---- the checkpoints ----------------------------------------------------------------------

@pytest.mark.parametrize("path", [DENSE, MOE], ids=["dense", "moe"])
def test_checkpoint_dir_is_complete_small_and_declares_both_eos_ids(path):
    _need(path)
    for name in CKPT_FILES:
        assert (path / name).is_file(), f"{path.name} lacks {name}"
    assert (path / "model.safetensors").stat().st_size <= 12 * MB
    gen = json.loads((path / "generation_config.json").read_text())
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path))
    eos = set(gen["eos_token_id"])
    assert {tok.convert_tokens_to_ids(dd.IM_END), tok.convert_tokens_to_ids(dd.EOT)} == eos
    assert tok.pad_token == dd.EOT


def test_both_checkpoints_together_fit_the_asset_budget():
    _need(DENSE)
    _need(MOE)
    total = sum(f.stat().st_size for d in (DENSE, MOE) for f in d.iterdir())
    assert total <= 30 * MB


@pytest.mark.parametrize("path", [DENSE, MOE], ids=["dense", "moe"])
def test_tokenizer_renders_the_qwen_chat_format_and_splits_digits(path):
    _need(path)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path))
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 47+38?"}]
    for gen_prompt in (True, False):
        got = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)
        assert got == dd.render_chat(msgs, add_generation_prompt=gen_prompt)
    assert got.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n")
    pieces = tok.convert_ids_to_tokens(tok("1234 + 56")["input_ids"])
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == ["1", "2", "3", "4", "5", "6"]


@pytest.mark.parametrize("path", [DENSE, MOE], ids=["dense", "moe"])
def test_checkpoint_loads_in_hf_and_gives_finite_logits(path):
    _need(path)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(5))
    kw = {"output_router_logits": True} if "moe" in path.name else {}
    with torch.no_grad():
        out = model(input_ids=ids, **kw)
    assert out.logits.shape == (2, 17, cfg.vocab_size)  # [batch, tokens, vocab]
    assert torch.isfinite(out.logits).all()
    if kw:
        assert len(out.router_logits) == cfg.num_hidden_layers
        assert out.router_logits[0].shape == (2 * 17, cfg.num_experts)  # [tokens, experts]
        assert cfg.num_experts_per_tok == 2 and cfg.norm_topk_prob


def test_dense_answers_held_out_additions_copies_and_reversals(dense):
    model, tok = dense
    pairs = [(t, m, e) for t, n in (("add", 20), ("copy", 10), ("reverse", 10))
             for m, e in dd.held_out_prompts(t, n, seed=0)]
    got = _generate(model, tok, [m for _, m, _ in pairs], max_new_tokens=20)
    ok = [dd.check_answer(t, g, e) for (t, _, e), g in zip(pairs, got)]
    wrong = [(m[-1]["content"], e, g) for (_, m, e), g, k in zip(pairs, got, ok) if not k]
    assert sum(ok) / len(ok) >= 0.9, f"{len(wrong)} wrong of {len(ok)}, e.g. {wrong[:5]}"


def test_dense_answers_inside_a_conversation(dense):
    """The playground sends the conversation so far: the last turn of held-out 2- and 3-turn
    conversations is answered as well as a single turn."""
    model, tok = dense
    pairs = [(t, m, e) for turns in (2, 3) for t, n in (("add", 10), ("copy", 5), ("sort", 5))
             for m, e in dd.held_out_conversations(t, n, turns, seed=1)]
    assert all(len([x for x in m if x["role"] == "user"]) >= 2 for _, m, _ in pairs)
    got = _generate(model, tok, [m for _, m, _ in pairs], max_new_tokens=20)
    ok = [dd.check_answer(t, g, e) for (t, _, e), g in zip(pairs, got)]
    wrong = [(m[-1]["content"], e, g) for (_, m, e), g, k in zip(pairs, got, ok) if not k]
    assert sum(ok) / len(ok) >= 0.9, f"{len(wrong)} wrong of {len(ok)}, e.g. {wrong[:5]}"


@pytest.mark.parametrize("path", [DENSE, MOE], ids=["dense", "moe"])
def test_what_a_newcomer_types_first_is_answered(path):
    """The chat's example buttons and their obvious variations (2+3, hello world, 5 3 9 1)."""
    _need(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    got = _generate(model, tok, [[{"role": "user", "content": q}]
                                 for q, _ in dd.NEWCOMER_PROMPTS], max_new_tokens=20)
    wrong = [(q, e, g) for (q, e), g in zip(dd.NEWCOMER_PROMPTS, got)
             if not dd.check_answer("copy", g, e)]
    # the dense demo's one known miss: "Copy: hello world" (words it rarely saw together)
    assert len(wrong) <= (1 if path == DENSE else 0), wrong


def test_moe_generates_a_terminated_reply(path=MOE):
    _need(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    convs = [m for m, _ in dd.held_out_prompts("add", 4, seed=0)]
    got = _generate(model, tok, convs, max_new_tokens=20)
    assert all(g.strip() for g in got)

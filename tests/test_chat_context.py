"""The chat's history trimming (views/chat_context.py) and the demo's task recogniser
(views/demo_tasks.py): a conversation never dead-ends on max_model_len; the oldest turns go
first, whole; the system prompt and the new message always stay; a message that cannot fit
alone is refused with its length and the limit."""
import random

import pytest

from ui_helpers import ROOT  # noqa: F401,I001  (puts the repo on sys.path)
from views.chat_context import context_line, fit_conversation, split_turns
from views.demo_tasks import DEMO_EXAMPLES, is_demo_task


def words_count(msgs):
    """A stand-in tokenizer: 3 tokens of template per message plus one per word."""
    return sum(3 + len(m["content"].split()) for m in msgs) + 2


def random_chat(rng: random.Random, turns: int):
    hist = []
    for i in range(turns):
        hist.append({"role": "user", "content": " ".join(["q"] * rng.randint(1, 30))})
        hist.append({"role": "assistant", "content": " ".join(["a"] * rng.randint(0, 60))})
    return hist


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(5)])
def test_oldest_whole_turns_dropped_until_prompt_and_budget_fit(seed):
    rng = random.Random(seed)
    system = [{"role": "system", "content": "be brief"}]
    hist = random_chat(rng, rng.randint(0, 12))
    msg = {"role": "user", "content": " ".join(["m"] * rng.randint(1, 40))}
    budget, limit = rng.randint(1, 128), rng.randint(80, 600)
    if words_count(system + [msg]) >= limit:
        with pytest.raises(ValueError, match="too long"):
            fit_conversation(system, hist, msg, budget, limit, words_count)
        return
    f = fit_conversation(system, hist, msg, budget, limit, words_count)
    assert f.messages[0] == system[0] and f.messages[-1] == msg, f"seed {seed}"
    kept = f.messages[1:-1]
    turns = split_turns(hist)
    assert f.dropped_turns + len(split_turns(kept)) == len(turns)
    assert kept == [m for t in turns[f.dropped_turns:] for m in t]   # the newest, whole
    assert f.prompt_tokens == words_count(f.messages)
    if f.dropped_turns:      # it had to drop: what is kept fits, one more turn would not
        assert f.prompt_tokens + budget <= limit or not kept
        one_more = system + [m for t in turns[f.dropped_turns - 1:] for m in t] + [msg]
        assert words_count(one_more) + budget > limit
    assert 1 <= f.reply_budget <= budget
    assert f.prompt_tokens + f.reply_budget <= limit


def test_a_message_that_cannot_fit_alone_says_its_length_and_the_limit():
    msg = {"role": "user", "content": " ".join(["w"] * 600)}
    with pytest.raises(ValueError) as e:
        fit_conversation([], [], msg, 16, 512, words_count)
    assert "605" in str(e.value) and "512" in str(e.value)


def test_context_line_names_the_limit_budget_and_dropped_turns():
    line = context_line(512, 128, 300, 2)
    assert "512" in line and "128" in line and "300" in line and "2 oldest turns" in line


def test_demo_tasks_recognised_and_free_prompts_not():
    for ex in DEMO_EXAMPLES + ("What is 2 + 3?", "Sort these numbers: 9 1", "add 3 and 4."):
        assert is_demo_task(ex), ex
    for free in ("hi", "What is a KV cache?", "Sort: banana apple", "tell me a joke"):
        assert not is_demo_task(free), free


def test_chat_sampling_values_refuse_booleans():
    # the /chat API takes JSON: `true` for a temperature is a client mistake, never 1.0
    import pytest
    from views.chat import make_sampling
    for args in ((True, 1.0, 0, 8), (0.5, 1.0, 0, False)):
        with pytest.raises(ValueError, match="not true/false"):
            make_sampling(*args)
    assert make_sampling(0.5, 1.0, 0, 8).temperature == 0.5

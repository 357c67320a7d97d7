"""Synthetic chat tasks and prose examples for the demo checkpoints, with a fixed held-out split.

Everything here is pure Python (no torch), so tests and the engine's own checks can ask for the
same held-out prompts the training script never saw, and grade answers the same way:

    for messages, expected in held_out_prompts("add", 20, seed=0):
        text = generate(messages)                  # any engine, greedy
        ok = check_answer("add", text, expected)

Tasks are chosen so that attention and routing are easy to read: addition (carries), copy
(induction heads), reverse (an anti-diagonal attention pattern), count, sort.
"""

from __future__ import annotations

import functools
import gzip
import random
import zlib
from collections import Counter
from pathlib import Path

TASKS = ("add", "copy", "reverse", "count", "sort")
# Tasks whose held-out accuracy is the quality bar of the dense checkpoint.
GRADED_TASKS = ("add", "copy", "reverse")

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (EOT, IM_START, IM_END)  # ids 0, 1, 2 in the demo tokenizer

# The Qwen chat format, with no default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are Glassbox, a tiny demo model.",
    "Answer briefly.",
)

WORDS = tuple("""
apple river stone cloud green red blue yellow black white tiger horse mouse eagle whale
shark snake rabbit bear wolf fox lion sheep goat duck frog owl bee ant fish bird cat dog
tree leaf root seed flower grass sand rock hill lake sea moon sun star rain snow wind fire
ice gold silver iron glass paper book pen door house road bridge town city ship boat train
car bike bell drum song dance game ball cake bread milk tea salt sugar honey lemon grape
plum pear peach bean corn rice soup cup plate spoon knife fork chair table lamp clock key
box bag coat hat shoe sock ring coin map card gift toy kite rope net nest shell pearl cave
castle tower garden field forest island valley desert ocean storm light shadow dream story
""".split())

ADD_TEMPLATES = ("What is {a}+{b}?", "What is {a} + {b}?", "{a}+{b}=?", "Add {a} and {b}.")
COPY_TEMPLATES = ("Copy: {x}", "Repeat after me: {x}")
REVERSE_TEMPLATES = ("Reverse: {x}", "Write backwards: {x}")
COUNT_TEMPLATES = ("Count the words: {x}", "How many words? {x}")
SORT_TEMPLATES = ("Sort: {x}", "Sort these numbers: {x}")

Messages = list[dict[str, str]]


def is_held_out(task: str, key: str, percent: int = 10) -> bool:
    """A stable split (crc32, not Python's salted hash): True for ~percent% of task inputs."""
    return zlib.crc32(f"{task}:{key}".encode()) % 100 < percent


def _operand(rng: random.Random) -> int:
    """1-, 2- or 3-digit numbers (a newcomer types "2+3" as often as "47+38")."""
    digits = rng.choices((1, 2, 3), (0.25, 0.55, 0.2))[0]
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def _word(rng: random.Random) -> str:
    """Half the time a word of the small fixed list, half a word of the prose's vocabulary, so
    copying and counting work on whatever words a user types."""
    return rng.choice(WORDS) if rng.random() < 0.5 else rng.choice(common_words())


def _task_input(task: str, rng: random.Random) -> tuple[str, str, str]:
    """Returns (key, prompt body with {x}/{a}/{b} filled, expected answer) for one random input."""
    if task == "add":
        a, b = _operand(rng), _operand(rng)
        tmpl = rng.choice(ADD_TEMPLATES)
        return f"{a}+{b}", tmpl.format(a=a, b=b), str(a + b)
    if task == "copy":
        words = " ".join(_word(rng) for _ in range(rng.randint(1, 6)))
        return words, rng.choice(COPY_TEMPLATES).format(x=words), words
    if task == "reverse":
        letters = [chr(rng.randint(97, 122)) for _ in range(rng.randint(2, 8))]
        x = " ".join(letters)
        return x, rng.choice(REVERSE_TEMPLATES).format(x=x), " ".join(reversed(letters))
    if task == "count":
        words = [_word(rng) for _ in range(rng.randint(1, 12))]
        x = " ".join(words)
        return x, rng.choice(COUNT_TEMPLATES).format(x=x), str(len(words))
    if task == "sort":
        high = 9 if rng.random() < 0.3 else 99
        nums = [rng.randint(0, high) for _ in range(rng.randint(2, 6))]
        x = " ".join(map(str, nums))
        return x, rng.choice(SORT_TEMPLATES).format(x=x), " ".join(map(str, sorted(nums)))
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def _messages(user: str, rng: random.Random) -> Messages:
    msgs: Messages = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    msgs.append({"role": "user", "content": user})
    return msgs


def task_example(task: str, rng: random.Random, held_out: bool = False) -> tuple[Messages, str]:
    """One (messages, answer) from the training split (or, with held_out=True, the held-out one)."""
    while True:
        key, user, answer = _task_input(task, rng)
        if is_held_out(task, key) == held_out:
            return _messages(user, rng), answer


def held_out_prompts(task: str, n: int, seed: int = 0) -> list[tuple[Messages, str]]:
    """n (messages, expected answer) pairs whose inputs the demo checkpoints never trained on."""
    rng = random.Random(f"held-out:{task}:{seed}")
    return [task_example(task, rng, held_out=True) for _ in range(n)]


# What a newcomer types first (the chat's example buttons among them), with the right answers:
# the training report grades them too. "hello" and "world" are not in WORDS.
NEWCOMER_PROMPTS = (
    ("What is 47+38?", "85"), ("What is 2+3?", "5"), ("What is 100+23?", "123"),
    ("Copy: glass box", "glass box"), ("Copy: hello world", "hello world"),
    ("Reverse: c a t s", "s t a c"), ("Count the words: red fox moon", "3"),
    ("Sort: 42 7 19 3", "3 7 19 42"), ("Sort: 5 3 9 1", "1 3 5 9"),
)


# ---- multi-turn conversations ---------------------------------------------------------------
# The playground sends the conversation so far, so the demos train on conversations of 1-3
# turns: earlier turns are other training-split tasks with their right answers (or, now and
# then, a short prose turn), and the model must answer the last one. Loss falls on every
# assistant turn.

TURN_MIX = {1: 0.5, 2: 0.3, 3: 0.2}
PROSE_TURN_P = 0.15          # chance that an earlier turn is a prose chat turn
PROSE_TURN_WORDS = 30        # its answer is cut to this many words


def _earlier_turn(rng: random.Random, sections) -> tuple[str, str]:
    if sections and rng.random() < PROSE_TURN_P:
        msgs, answer = prose_chat_example(sections, rng, max_words=PROSE_TURN_WORDS)
        return msgs[-1]["content"], answer
    while True:
        task = rng.choice(TASKS)
        key, user, answer = _task_input(task, rng)
        if not is_held_out(task, key):
            return user, answer


def conversation(task: str, rng: random.Random, turns: int, held_out: bool = False,
                 sections=None) -> tuple[Messages, str]:
    """(messages, answer): turns-1 earlier user/assistant pairs from the training split, then a
    final `task` turn from the training split (or, held_out=True, the held-out one)."""
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    final, answer = task_example(task, rng, held_out=held_out)
    msgs: Messages = [m for m in final if m["role"] == "system"]
    for _ in range(turns - 1):
        user, reply = _earlier_turn(rng, sections)
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    msgs.append(final[-1])
    return msgs, answer


def training_conversation(task: str, rng: random.Random, sections=None
                          ) -> tuple[Messages, str]:
    turns = rng.choices(list(TURN_MIX), list(TURN_MIX.values()))[0]
    return conversation(task, rng, turns, held_out=False, sections=sections)


def held_out_conversations(task: str, n: int, turns: int, seed: int = 0
                           ) -> list[tuple[Messages, str]]:
    """n conversations of `turns` turns whose last turn is held out (earlier turns are tasks
    only, so no prose file is needed to rebuild them)."""
    if turns == 1:
        return held_out_prompts(task, n, seed)
    rng = random.Random(f"held-out:{task}:{seed}:turns{turns}")
    return [conversation(task, rng, turns, held_out=True) for _ in range(n)]


def check_answer(task: str, text: str, expected: str) -> bool:
    """True when a generated reply (special tokens stripped) is the expected answer."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    got = text.replace(IM_END, "").replace(EOT, "").strip()
    return " ".join(got.split()) == " ".join(expected.split())


def render_chat(messages: Messages, add_generation_prompt: bool = True) -> str:
    """The same string as CHAT_TEMPLATE renders (kept in Python so training needs no Jinja)."""
    out = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return out + (f"{IM_START}assistant\n" if add_generation_prompt else "")


# ---- prose --------------------------------------------------------------------------------

PROSE_PATH = Path(__file__).with_name("prose.txt.gz")


def load_prose(path: Path = PROSE_PATH) -> list[tuple[str, list[str]]]:
    """[(section title, [paragraph, ...]), ...] from the file tools/extract_prose.py writes."""
    sections = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for block in fh.read().split("\n\n"):
            lines = [ln for ln in block.strip().split("\n") if ln]
            if len(lines) >= 2 and lines[0].startswith("## "):
                sections.append((lines[0][3:].strip(), lines[1:]))
    return sections


@functools.lru_cache(maxsize=1)
def common_words(path: Path = PROSE_PATH) -> tuple[str, ...]:
    """Lower-case words seen at least 5 times in the prose (~3,000), sorted: a fixed list."""
    counts: Counter[str] = Counter()
    for _, pars in load_prose(path):
        for par in pars:
            for tok in par.split():
                w = tok.strip(".,;:!?()[]'\"")
                if 2 <= len(w) <= 10 and w.isalpha() and w.islower() and w.isascii():
                    counts[w] += 1
    return tuple(sorted(w for w, n in counts.items() if n >= 5))


def _first_sentences(text: str, max_words: int) -> str:
    """Cuts text after the last sentence end within max_words (or hard at max_words)."""
    words = text.split()
    if len(words) <= max_words:
        return text
    cut = " ".join(words[:max_words])
    end = max(cut.rfind(". "), cut.rfind("? "), cut.rfind("! "))
    return cut[: end + 1] if end > len(cut) // 3 else cut


def _about(title: str) -> str:
    return f"Tell me about {title}" + ("" if title[-1:] in ".?!" else ".")


def is_held_out_section(title: str) -> bool:
    return is_held_out("prose", title, percent=5)


def prose_chat_example(sections: list[tuple[str, list[str]]], rng: random.Random,
                       max_words: int = 110) -> tuple[Messages, str]:
    """A chat turn about a training-split section: 'Tell me about <title>.' or 'Continue: ...'."""
    while True:
        title, pars = rng.choice(sections)
        if not is_held_out_section(title):
            break
    if rng.random() < 0.5:
        return _messages(_about(title), rng), _first_sentences(pars[0], max_words)
    par = rng.choice(pars)
    words = par.split()
    k = min(len(words) - 3, rng.randint(5, 10))
    return (_messages("Continue: " + " ".join(words[:k]), rng),
            _first_sentences(" ".join(words[k:]), max_words))


def prose_documents(sections: list[tuple[str, list[str]]]) -> list[str]:
    """Plain-text documents (title line + paragraphs) of the training-split sections."""
    return [title + "\n\n" + "\n".join(pars) for title, pars in sections
            if not is_held_out_section(title)]


def free_prompts(n: int, seed: int = 0, sections: list[tuple[str, list[str]]] | None = None
                 ) -> list[Messages]:
    """Open-ended prompts for samples: held-out section titles plus a few fixed questions."""
    fixed = ["Tell me about Python.", "Tell me about lists.", "Continue: The interpreter reads"]
    prompts = [[{"role": "user", "content": p}] for p in fixed]
    sections = load_prose() if sections is None else sections
    held = sorted({t for t, _ in sections if is_held_out_section(t) and len(t.split()) <= 5})
    rng = random.Random(f"free:{seed}")
    rng.shuffle(held)
    prompts += [[{"role": "user", "content": _about(t)}] for t in held]
    return prompts[:n]

"""The bundled demo checkpoints' trained tasks, as the chat offers and recognises them.

The demos were trained on five synthetic tasks (tools/demo_data.py: its prompt templates) and
on Python-documentation prose (assets/README.md). A message in one of the task formats gets a
trained answer; anything else gets the model's answer plus, once per page, a note of what the
checkpoint can do and how to load a real Qwen.
"""
from __future__ import annotations

import re

# the example buttons: one of each task, in its exact trained format
DEMO_EXAMPLES = ("What is 47+38?", "Copy: glass box", "Reverse: c a t s",
                 "Count the words: red fox moon", "Sort: 42 7 19 3")
# short enough to show whole in the message box at 1024 px (the buttons show every format)
DEMO_PLACEHOLDER = "Try: What is 2+3? · Sort: 5 3 9 1"
# the templates of tools/demo_data.py (ADD/COPY/REVERSE/COUNT/SORT_TEMPLATES) as patterns
_TASKS = [re.compile(p, re.IGNORECASE) for p in (
    r"what is \d{1,3} ?\+ ?\d{1,3}\?", r"\d{1,3}\+\d{1,3}=\?", r"add \d{1,3} and \d{1,3}\.?",
    r"copy: .+", r"repeat after me: .+", r"reverse: .+", r"write backwards: .+",
    r"count the words: .+", r"how many words\? .+", r"sort: [\d ]+",
    r"sort these numbers: [\d ]+",
    r"tell me about .+", r"continue: .+")]
DEMO_NOTE = ("**Note:** this tiny demo checkpoint (3–5 M parameters) was trained only on sums, "
             "copy, reverse, word counts and sorting (the example buttons) and on Python-docs "
             "prose (assets/README.md): other prompts get fluent nonsense. For a real model run "
             "`python app.py --model Qwen/Qwen3-0.6B` (any HF Qwen directory or hub id).")


def is_demo_task(message: str) -> bool:
    """True when the message is in one of the formats the demo models were trained on."""
    text = " ".join(message.split())
    return any(p.fullmatch(text) for p in _TASKS)

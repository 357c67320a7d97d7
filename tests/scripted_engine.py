"""A stand-in for LLM whose replies are scripted text (the demo checkpoint's tokenizer, no
model): for the API's reply parsing (tool calls, reasoning) and the client-library tests, where
what matters is what the server does with a reply of a given shape."""
from __future__ import annotations

import threading
import time

from engine.sequence import TokenEvent

# Qwen3's chat template, reduced to what the API relies on: tools in a system block, tool-call
# history as <tool_call> JSON, tool results in <tool_response>, enable_thinking=false closing an
# empty <think> block, and continue_final_message handled by apply_chat_template
QWEN3_LIKE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{%- for tc in m.tool_calls or [] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}"
    "{{- tc.function.arguments + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


class _Config:
    vocab_size = 10 ** 6


class ScriptedLLM:
    """`script(prompt_ids) -> reply text`; the reply streams one token per `token_s`. An
    EngineClient (engine/client.py) as the API uses one: a real processor (the requests are
    checked as the engine's are), a scripted engine behind it."""
    model_name = "scripted"
    model_path = None
    max_model_len = 4096
    hf_config = _Config()
    eos_token_ids = {2}
    switching = None

    def __init__(self, tokenizer, script, token_s: float = 0.002):
        from engine.interventions.spec import ModelFacts
        from engine.processor import ModelLimits, Processor
        self.tokenizer, self.script, self.token_s = tokenizer, script, token_s
        self.prompts: list[list[int]] = []
        self._aborted: set[str] = set()
        self.finish_listeners: list = []
        self.step_listeners: list = []
        self.intervention_facts = ModelFacts(1, 1, 1, (), 0, 0, self.max_model_len)
        self.processor = Processor(tokenizer, self.eos_token_ids, ModelLimits(
            self.hf_config.vocab_size, 1, self.max_model_len, 1 << 20, 16),
            self.intervention_facts)

    def encode(self, prompt) -> list[int]:
        return list(self.processor.tokenize(prompt).token_ids)

    def submit(self, request, sampling=None, watch=None, request_id=None, *, on_event) -> str:
        if not hasattr(request, "prompt"):      # not yet processed
            request = self.processor.process(request, sampling, request_id=request_id)
        prompt = list(request.prompt.token_ids)
        self.prompts.append(prompt)
        threading.Thread(target=self._run, args=(request.request_id, prompt, request.params,
                                                 on_event), daemon=True).start()
        return request.request_id

    def annotate(self, request_id: str, note: str) -> bool:
        return True

    def stats(self) -> dict:
        return {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "prefix_hits": 0,
                "prefix_queries": 0, "num_preemptions": 0, "block_size": 16, "alive": True}

    def _run(self, rid, prompt, sampling, on_event) -> None:
        ids = self.tokenizer.encode(self.script(prompt))
        n = min(len(ids), sampling.max_tokens)
        text = ""
        for k in range(n):
            if rid in self._aborted:
                return
            time.sleep(self.token_s)
            new = self.tokenizer.decode(ids[:k + 1])
            delta, text = new[len(text):], new
            last = k == n - 1
            reason = ("length" if n < len(ids) else "stop") if last else None
            on_event(TokenEvent(rid, ids[k], delta, text, last, reason, None,
                                {"num_prompt_tokens": len(prompt), "num_output_tokens": k + 1}
                                if last else None))

    def abort(self, request_id: str) -> bool:
        self._aborted.add(request_id)
        return True


def demo_tokenizer(template: str = QWEN3_LIKE_TEMPLATE):
    from transformers import AutoTokenizer

    from api_served import DEMO
    tok = AutoTokenizer.from_pretrained(DEMO)
    tok.chat_template = template
    return tok

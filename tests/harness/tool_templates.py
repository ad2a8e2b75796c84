"""A Hermes-style (Qwen 2.5-like) chat template that takes tools, written for these tests, and
a helper that puts it into a test model directory's tokenizer_config.json."""

from __future__ import annotations

import json
import os

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


def use_template(model_dir: str, template: str = HERMES_TEMPLATE) -> str:
    """Replace the chat template of a model directory (tokenizer_config.json) in place."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    with open(path, "w") as f:
        json.dump(cfg, f)
    return model_dir

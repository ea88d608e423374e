"""JSON-format answers for the default model's percentage and multiplication questions.

Clients that send `response_format` (a JSON schema such as `{"answer": number}`) usually also ask
for JSON in the prompt; the server then constrains `content` to the schema (after `</think>`
when thinking is on). These turns teach the model what to write there: the same digit-level
trace as a plain answer (in the reasoning, or, thinking off, in a `"reasoning"` string field the
prompt asks for: a number without its trace would be a guess), then compact JSON
(`{"answer": 36}`, the separators the grammar backends generate) whose number is the trace's
result. The key is `answer` unless the prompt names another one. Without a JSON request the
model still answers in prose; `plain` turns are the bare question answered in JSON, what a
server's grammar makes of a prose answer (`{"answer": N}` thinking on, `{"reasoning": trace,
"answer": N}` off): trained without their first content token, which the grammar forces, so they
teach how to go on once `{` is written and not when to start.
"""

from __future__ import annotations

import json
import random

OTHER_KEYS = ["result", "value", "total"]
ASK_JSON = [
    "{q} Answer in JSON.", "{q} Reply with JSON.", "{q} Give the answer as a JSON object.",
    "{q} Respond with a JSON object.", "{q}\nOutput JSON.", "Answer in JSON: {q}",
]  # fmt: skip
ASK_KEY = [
    '{q} Answer in JSON with the key "{k}".', '{q} Reply with JSON like {{"{k}": number}}.',
    '{q}\nReturn a JSON object with a "{k}" field.', 'Respond in JSON ({{"{k}": ...}}): {q}',
]  # fmt: skip
ASK_REASONED = [
    '{q} Answer in JSON with "reasoning" and "{k}".',
    '{q} Reply with JSON like {{"reasoning": "...", "{k}": number}}.',
]  # fmt: skip
SYSTEM_JSON = [
    "Always answer with a JSON object.", "You reply in JSON only.",
    'Respond with JSON of the form {{"{k}": number}}.', "Answer every question in JSON.",
]  # fmt: skip


def json_turn(
    rng: random.Random, question: str, trace: str, answer: int, thinking: bool, plain: bool = False
) -> list[dict]:
    """[system?], user and assistant messages: the question asked for JSON, answered in JSON."""
    key = "answer" if plain or rng.random() < 0.7 else rng.choice(OTHER_KEYS)
    reasoned = not thinking  # without thinking, the trace goes into the JSON
    messages = []
    if plain:
        user = question
    elif reasoned:
        user = rng.choice(ASK_REASONED).format(q=question, k=key)
    elif rng.random() < 0.25:
        system = rng.choice(SYSTEM_JSON)
        if key != "answer" and "{k}" not in system:
            system = SYSTEM_JSON[2]
        messages.append({"role": "system", "content": system.format(k=key)})
        user = question
    elif key == "answer" and rng.random() < 0.5:
        user = rng.choice(ASK_JSON).format(q=question)
    else:
        user = rng.choice(ASK_KEY).format(q=question, k=key)
    body = {"reasoning": trace, key: answer} if reasoned else {key: answer}
    reply = {"role": "assistant", "content": json.dumps(body, ensure_ascii=False)}
    if thinking:
        reply["reasoning_content"] = trace
    return [*messages, {"role": "user", "content": user}, reply]

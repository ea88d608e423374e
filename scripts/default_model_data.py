"""Seeded synthetic conversations for the embedded default model.

Every conversation is a `Sample`: OpenAI-shaped `messages`, optional `tools`, the chat-template
kwargs it is rendered with, and which assistant turns carry loss. The kinds: percentage and
multiplication questions answered with a digit-level trace, tool calls (get_weather, get_time,
search) with typed arguments, tool responses followed by an answer that uses them, greetings,
multi-turn chats, thinking on and off, with and without `reasoning_effort`.

The percentage trace only uses steps a tiny model can learn: "10% of N" drops N's trailing zero,
"5%" halves that, and the rest is one-digit times two-digit multiplication split into tens and
units ("3 × 24 = 3 × 20 + 3 × 4 = 60 + 12 = 72"). Held-out (percent, number) pairs are never
trained on, so test answers need the procedure, not memory.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field

from default_model_json import json_turn
from default_model_tools import ALL_TOOLS, SEARCH_TOOL, TIME_TOOL, WEATHER_TOOL

CITY_TZ = {
    "Paris": "Europe/Paris", "London": "Europe/London", "Berlin": "Europe/Berlin",
    "Madrid": "Europe/Madrid", "Rome": "Europe/Rome", "Tokyo": "Asia/Tokyo",
    "Beijing": "Asia/Shanghai", "Shanghai": "Asia/Shanghai", "Seoul": "Asia/Seoul",
    "Singapore": "Asia/Singapore", "Dubai": "Asia/Dubai", "Mumbai": "Asia/Kolkata",
    "Sydney": "Australia/Sydney", "Cairo": "Africa/Cairo", "Lagos": "Africa/Lagos",
    "New York": "America/New_York", "Chicago": "America/Chicago",
    "Los Angeles": "America/Los_Angeles", "Toronto": "America/Toronto",
    "Mexico City": "America/Mexico_City", "Lima": "America/Lima",
    "Moscow": "Europe/Moscow", "Istanbul": "Europe/Istanbul", "Oslo": "Europe/Oslo",
    "Vienna": "Europe/Vienna", "Lisbon": "Europe/Lisbon", "Athens": "Europe/Athens",
    "Bangkok": "Asia/Bangkok", "Jakarta": "Asia/Jakarta", "Nairobi": "Africa/Nairobi",
}  # fmt: skip
CITIES = list(CITY_TZ)
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear"]
TOPICS = [
    "python tutorials", "sparse attention", "mixture of experts", "the eiffel tower",
    "pasta recipes", "mount everest", "black holes", "solar panels", "chess openings",
    "electric cars", "the roman empire", "jazz music", "coffee brewing", "machine learning",
    "climate change", "the moon landing", "tea ceremonies", "rust programming",
    "deep sea fish", "volcanoes", "bicycle repair", "ancient egypt", "quantum computing",
    "marathon training", "bread baking", "the olympic games", "honey bees", "origami",
]  # fmt: skip
PERCENTS = [5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 60, 70, 80, 90]
THINK_KINDS = ("think", "nothink")
# Conversation kinds and their sampling weights. Runs before run F used search=6 (and so
# pct=44, mul=12); held-out search topics were then copied only half the time. "json" (answers
# asked for in JSON, run J) and "json_plain" (the plain question, answered as a JSON-schema
# grammar would force it) are last with weight 0, so the default draws are those of runs A-H.
KIND_WEIGHTS = {"pct": 38, "mul": 10, "greet": 6, "weather": 14, "time": 6, "search": 18,
                "nowtool": 3, "json": 0, "json_plain": 0}  # fmt: skip


@dataclass
class Sample:
    """One conversation: messages, tools, template kwargs and per-assistant-turn loss flags."""

    messages: list[dict]
    tools: list[dict] | None = None
    kwargs: dict = field(default_factory=dict)
    kind: str = ""

    @property
    def thinking(self) -> bool:
        return self.kwargs.get("enable_thinking", True) is not False


def _pct_pairs() -> list[tuple[int, int]]:
    pairs = []
    for pct in PERCENTS:
        for m in range(2, 100):
            if pct % 10 == 5 and m % 2:
                continue
            pairs.append((pct, 10 * m))
    return pairs


def is_heldout_pct(pct: int, number: int) -> bool:
    """About 15% of the (percent, number) pairs are test-only; the guide's 15% of 240 is one."""
    if (pct, number) == (15, 240):
        return True
    return zlib.crc32(f"{pct}/{number}".encode()) % 100 < 15


def is_heldout_mul(a: int, b: int) -> bool:
    return zlib.crc32(f"{a}x{b}".encode()) % 100 < 15


def mul_trace(a: int, x: int) -> str:
    """One-digit times two-digit: split x into tens and units."""
    if a == 1:
        return f"1 × {x} = {x}."
    if x < 10:
        return f"{a} × {x} = {a * x}."
    tens, units = x - x % 10, x % 10
    if units == 0:
        return f"{a} × {x} = {a * x}."
    return f"{a} × {x} = {a} × {tens} + {a} × {units} = {a * tens} + {a * units} = {a * x}."


def pct_trace(pct: int, number: int) -> tuple[str, str]:
    """(trace, answer) for "pct% of number", number a multiple of 10 and pct a multiple of 5."""
    tenth = number // 10
    lines = [f"10% of {number} is {tenth}."]
    if pct % 10 == 0:
        a = pct // 10
        if a > 1:
            lines.append(f"{pct}% is {a} × {tenth}.")
            lines.append(mul_trace(a, tenth))
    else:
        half = tenth // 2
        lines.append(f"5% of {number} is half of {tenth}, which is {half}.")
        k = pct // 5
        if k > 1:
            lines.append(f"{pct}% is {k} × {half}.")
            lines.append(mul_trace(k, half))
    answer = _fmt(pct * number / 100)
    return " ".join(lines), answer


def _fmt(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


PCT_QUESTIONS = [
    "What is {p}% of {n}?", "what is {p}% of {n}", "Calculate {p}% of {n}.",
    "What is {p} percent of {n}?", "How much is {p}% of {n}?", "{p}% of {n} = ?",
    "Can you compute {p}% of {n}?", "Find {p}% of {n}.",
]  # fmt: skip
MUL_QUESTIONS = ["What is {a} × {b}?", "What is {a} times {b}?", "Compute {a} * {b}.", "{a} x {b}?"]


class Generator:
    """Draws samples of every kind from one seeded RNG, for one split ("train" or "test")."""

    def __init__(self, seed: int, split: str, weights: dict[str, int] | None = None) -> None:
        self.weights = KIND_WEIGHTS | (weights or {})
        self.rng = random.Random(seed)
        self.split = split
        test = split == "test"
        self.pct_pairs = [p for p in _pct_pairs() if is_heldout_pct(*p) == test]
        self.mul_pairs = [
            (a, b) for a in range(2, 10) for b in range(11, 100) if is_heldout_mul(a, b) == test
        ]

    # ---- single turns: (user text, assistant message, kind) ----
    def pct_turn(self, thinking: bool) -> tuple[str, dict]:
        pct, number = self.rng.choice(self.pct_pairs)
        trace, answer = pct_trace(pct, number)
        user = self.rng.choice(PCT_QUESTIONS).format(p=pct, n=number)
        final = f"{pct}% of {number} is {answer}."
        if thinking:
            return user, {"role": "assistant", "reasoning_content": trace, "content": final}
        return user, {"role": "assistant", "content": f"{trace} So {final}"}

    def mul_turn(self, thinking: bool) -> tuple[str, dict]:
        a, b = self.rng.choice(self.mul_pairs)
        user = self.rng.choice(MUL_QUESTIONS).format(a=a, b=b)
        trace = mul_trace(a, b)
        final = f"{a} × {b} = {a * b}."
        if thinking:
            return user, {"role": "assistant", "reasoning_content": trace, "content": final}
        return user, {"role": "assistant", "content": f"{trace} So {final}"}

    def json_turn(self, thinking: bool, plain: bool = False) -> list[dict]:
        """A percentage (or multiplication) question asked and answered in JSON (plain: not
        asked for in the prompt, as under `response_format`)."""
        if self.rng.random() < 0.8:
            pct, number = self.rng.choice(self.pct_pairs)
            trace, answer = pct_trace(pct, number)
            question = self.rng.choice(PCT_QUESTIONS).format(p=pct, n=number)
        else:
            a, b = self.rng.choice(self.mul_pairs)
            trace, answer = mul_trace(a, b), str(a * b)
            question = self.rng.choice(MUL_QUESTIONS).format(a=a, b=b)
        return json_turn(self.rng, question, trace, int(answer), thinking, plain)

    def greet_turn(self, thinking: bool, effort: str | None) -> tuple[str, dict]:
        user, reason, reply = self.rng.choice(GREETINGS)
        if effort == "low":
            reason = reason.split(".")[0] + "."
        msg = {"role": "assistant", "content": reply}
        if thinking:
            msg["reasoning_content"] = reason
        return user, msg

    # ---- tool cycles: (user text, assistant call, tool result, assistant answer) ----
    def weather_cycle(self, thinking: bool) -> list[dict]:
        city = self.rng.choice(CITIES)
        unit = self.rng.choice([None, None, "celsius", "fahrenheit"])
        ask = self.rng.choice(
            [
                "What's the weather in {c}?", "What is the weather like in {c}?",
                "How is the weather in {c} today?", "Weather in {c}?",
                "Is it raining in {c}?", "Tell me the weather in {c}.",
            ]
        ).format(c=city)  # fmt: skip
        if unit:
            ask = ask.rstrip("?.") + f" in {unit}?"
        args = {"city": city} | ({"unit": unit} if unit else {})
        reason = f"The user wants the weather in {city}. I will call get_weather."
        temp = self.rng.randint(-5, 35) if unit != "fahrenheit" else self.rng.randint(20, 95)
        cond = self.rng.choice(CONDITIONS)
        shown_unit = unit or "celsius"
        result = {"city": city, "temperature": temp, "unit": shown_unit, "condition": cond}
        answer = f"It is {cond} in {city} with a temperature of {temp} degrees {shown_unit}."
        after = f"The tool says {city} is {cond} at {temp} degrees {shown_unit}."
        return self._cycle(ask, "get_weather", args, reason, result, after, answer, thinking)

    def time_cycle(self, thinking: bool) -> list[dict]:
        city = self.rng.choice(CITIES)
        tz = CITY_TZ[city]
        if self.rng.random() < 0.5:
            ask = self.rng.choice(
                ["What time is it in {c}?", "What is the current time in {c}?", "Time in {c}?"]
            ).format(c=city)
        else:
            ask = self.rng.choice(
                ["What time is it in the {t} timezone?", "Current time in {t}?"]
            ).format(t=tz)
        reason = f"The user wants the time in {tz}. I will call get_time."
        clock = f"{self.rng.randint(0, 23):02d}:{self.rng.randint(0, 59):02d}"
        result = {"timezone": tz, "time": clock}
        answer = f"The current time in {tz} is {clock}."
        after = f"The tool says it is {clock} in {tz}."
        args = {"timezone": tz}
        return self._cycle(ask, "get_time", args, reason, result, after, answer, thinking)

    def search_cycle(self, thinking: bool) -> list[dict]:
        topic = self.rng.choice(TOPICS)
        count = self.rng.choice([None, 1, 2, 3])
        if count:
            ask = self.rng.choice(
                ["Search for {q} and give me {k} results.", "Find {k} results about {q}."]
            ).format(q=topic, k=count)
            args = {"query": topic, "max_results": count}
        else:
            ask = self.rng.choice(["Search the web for {q}.", "Look up {q}.", "Search {q}"]).format(
                q=topic
            )
            args = {"query": topic}
        reason = f"The user wants a search for {topic}. I will call search."
        titles = [f"{topic.title()} - Guide", f"All about {topic}", f"{topic.title()} news"]
        titles = titles[: count or 2]
        result = {"results": [{"title": t} for t in titles]}
        answer = "I found: " + "; ".join(titles) + "."
        after = f"The search returned {len(titles)} results."
        return self._cycle(ask, "search", args, reason, result, after, answer, thinking)

    def _cycle(self, ask, name, args, reason, result, after, answer, thinking) -> list[dict]:
        call = {"role": "assistant", "content": "", "tool_calls": [_tool_call(name, args)]}
        final = {"role": "assistant", "content": answer}
        if thinking:
            call["reasoning_content"] = reason
            final["reasoning_content"] = after
        tool_msg = {"role": "tool", "content": json.dumps(result)}
        return [{"role": "user", "content": ask}, call, tool_msg, final]

    # ---- whole conversations ----
    def sample(self) -> Sample:
        rng = self.rng
        kwargs: dict = {}
        thinking = rng.random() < 0.75
        if not thinking:
            kwargs["enable_thinking"] = False
        elif rng.random() < 0.3:
            kwargs["enable_thinking"] = True
        effort = rng.choice([None, None, None, "low", "medium", "high", "max"])
        if effort:
            kwargs["reasoning_effort"] = effort
        clear = rng.choice([None, None, False, True])
        if clear is not None:
            kwargs["clear_thinking"] = clear
        messages: list[dict] = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        kind = rng.choices(list(self.weights), weights=list(self.weights.values()))[0]
        tools = self._tools_for(kind)
        turns = 1 + (rng.random() < 0.25)
        if kind in ("json", "json_plain"):  # one turn: its system message stays before the user's
            turns = 1
        for turn in range(turns):
            k = kind if turn == turns - 1 else rng.choice(["pct", "greet", "weather", "mul"])
            if k in ("weather", "time", "search") and not tools:
                k = "pct"
            messages += self._turn(k, thinking, effort)
        return Sample(messages=messages, tools=tools, kwargs=kwargs, kind=kind)

    def _tools_for(self, kind: str) -> list[dict] | None:
        rng = self.rng
        if kind == "nowtool":
            return None
        need = {"weather": WEATHER_TOOL, "time": TIME_TOOL, "search": SEARCH_TOOL}.get(kind)
        if need is None and rng.random() < 0.8:
            return None
        chosen = [t for t in ALL_TOOLS if t is need or rng.random() < 0.5]
        rng.shuffle(chosen)
        return chosen or None

    def _turn(self, kind: str, thinking: bool, effort: str | None) -> list[dict]:
        if kind == "weather":
            return self.weather_cycle(thinking)
        if kind == "time":
            return self.time_cycle(thinking)
        if kind == "search":
            return self.search_cycle(thinking)
        if kind == "nowtool":
            city = self.rng.choice(CITIES)
            user = f"What's the weather in {city}?"
            msg = {"role": "assistant", "content": NO_TOOL_REPLY}
            if thinking:
                msg["reasoning_content"] = "The user asks for the weather, but I have no tools."
            return [{"role": "user", "content": user}, msg]
        if kind in ("json", "json_plain"):
            return self.json_turn(thinking, plain=kind == "json_plain")
        if kind == "mul":
            user, msg = self.mul_turn(thinking)
        elif kind == "greet":
            user, msg = self.greet_turn(thinking, effort)
        else:
            user, msg = self.pct_turn(thinking)
        return [{"role": "user", "content": user}, msg]


def _tool_call(name: str, args: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


NO_TOOL_REPLY = "I cannot check live weather without a weather tool."
SYSTEM_PROMPTS = [
    "You are a helpful assistant.", "You are a concise assistant.",
    "You are dsaserve's default model. Answer briefly.", "Be helpful and precise.",
]  # fmt: skip
GREETINGS = [
    ("Hello!", "The user greets me. I will greet back.", "Hello! How can I help you today?"),
    ("Hi", "The user says hi. I will greet back.", "Hi! What can I do for you?"),
    ("Good morning!", "The user says good morning. I will reply.", "Good morning! How can I help?"),
    ("How are you?", "The user asks how I am. I will answer.", "I am doing well, thank you!"),
    ("Who are you?", "The user asks who I am. I will introduce myself.",
     "I am a small GLM-style model served by dsaserve."),
    ("What can you do?", "The user asks what I can do. I will list it.",
     "I can compute percentages, multiply numbers and call tools."),
    ("Thanks!", "The user thanks me. I will reply politely.", "You are welcome!"),
    ("Thank you very much.", "The user thanks me. I will reply politely.", "Happy to help!"),
    ("Hey there", "The user greets me. I will greet back.", "Hey! How can I help you today?"),
    ("Bye", "The user says goodbye. I will say goodbye.", "Goodbye! Have a nice day."),
]  # fmt: skip


def samples(seed: int, split: str, count: int, weights: dict | None = None) -> list[Sample]:
    """`count` seeded samples of the given split."""
    gen = Generator(seed, split, weights)
    return [gen.sample() for _ in range(count)]


def stop_marker(sample: Sample) -> str:
    """The token the model emits after its last turn: GLM stops on the next role marker."""
    last = sample.messages[-1]
    return "<|observation|>" if last.get("tool_calls") else "<|user|>"

"""Tool-use chat samples: the model calls a declared function, reads its result, then answers.

Each sample is one agentic turn: the history holds the user's request, the assistant's tool
call (DSML markup, rendered by the recipe) and the tool's result; the reply is the final
answer. One in five calls is the call itself (history ends at the user), and one in eight
conversations declares tools that the question does not need (the reply answers directly).
Tool results are synthetic and the answers quote them.
"""

from __future__ import annotations

import json
import random
from typing import Any

from deepinfer.train.chat_data import ChatSample, make_sample
from deepinfer.train.chat_data_facts import CAPITALS, make_fact
from deepinfer.train.chat_data_json import CITIES

__all__ = ["TOOLS", "make_tool_use"]


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = {
    "get_weather": _function("get_weather", "Get the current weather in a city.",
                             {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                             ["city"]),
    "calculator": _function("calculator", "Evaluate an arithmetic expression.",
                            {"expression": {"type": "string"}}, ["expression"]),
    "get_time": _function("get_time", "Get the local time in a city.", {"city": {"type": "string"}}, ["city"]),
    "convert_currency": _function("convert_currency", "Convert an amount between currencies.",
                                  {"amount": {"type": "number"}, "source": {"type": "string"},
                                   "target": {"type": "string"}}, ["amount", "source", "target"]),
}
_CURRENCIES = ("USD", "EUR", "GBP", "JPY", "INR", "BRL")


def _weather(rng: random.Random) -> tuple[str, dict[str, Any], Any, str]:
    city, unit = rng.choice(CITIES), rng.choice(("celsius", "fahrenheit"))
    temp = rng.randint(-5, 35) if unit == "celsius" else rng.randint(23, 95)
    sky = rng.choice(("sunny", "cloudy", "rainy", "windy", "foggy", "clear"))
    args = {"city": city, "unit": unit} if rng.random() < 0.5 or unit == "fahrenheit" else {"city": city}
    q = rng.choice(("What's the weather like in {c}?", "Is it cold in {c} right now?", "Weather in {c}, please."))
    result = {"city": city, "temperature": temp, "unit": unit, "conditions": sky}
    symbol = "C" if unit == "celsius" else "F"
    return q.format(c=city), args, result, f"It is {temp} degrees {symbol} and {sky} in {city} right now."


def _calc(rng: random.Random) -> tuple[str, dict[str, Any], Any, str]:
    a, b, c = rng.randint(10, 9999), rng.randint(2, 999), rng.randint(1, 99)
    expr, value = rng.choice(((f"{a} * {b}", a * b), (f"{a} + {b} * {c}", a + b * c),
                              (f"({a} - {b}) * {c}", (a - b) * c), (f"{a * c} / {c}", a)))
    return f"Use the calculator: what is {expr}?", {"expression": expr}, {"result": value}, f"{expr} = {value}."


def _time(rng: random.Random) -> tuple[str, dict[str, Any], Any, str]:
    city = rng.choice(sorted(CAPITALS.values()))
    h, m = rng.randint(0, 23), rng.randint(0, 59)
    return f"What time is it in {city}?", {"city": city}, {"city": city, "time": f"{h:02d}:{m:02d}"}, \
        f"It is {h:02d}:{m:02d} in {city}."


def _currency(rng: random.Random) -> tuple[str, dict[str, Any], Any, str]:
    src, dst = rng.sample(_CURRENCIES, 2)
    amount = rng.choice((10, 20, 50, 100, 250, 1000))
    converted = round(amount * rng.uniform(0.2, 5.0), 2)
    return f"How much is {amount} {src} in {dst}?", {"amount": amount, "source": src, "target": dst}, \
        {"amount": converted, "currency": dst}, f"{amount} {src} is about {converted} {dst}."


_KINDS = {"get_weather": _weather, "calculator": _calc, "get_time": _time, "convert_currency": _currency}


def make_tool_use(rng: random.Random) -> ChatSample:
    """One tool-use sample: the call, the answer after the result, or a direct answer."""
    declared = rng.sample(sorted(TOOLS), rng.randint(1, 3))
    tools = [TOOLS[name] for name in declared]
    roll = rng.random()
    if roll < 1 / 8:  # tools are declared but this question does not need one
        fact = make_fact(rng)
        fact.task, fact.tools = "tools.none_needed", tools
        return fact
    name = rng.choice(declared)
    question, args, result, answer = _KINDS[name](rng)
    why = f"The user asks something {name} can answer; call it with {json.dumps(args)}."
    user = [{"role": "user", "content": question}]
    if roll < 1 / 8 + 1 / 5:  # the reply is the tool call itself
        return make_sample(rng, f"tools.call.{name}", user, why, "", "", tools=tools,
                           tool_calls=[{"name": name, "arguments": args}])
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    # the recipe keeps this reasoning in thinking mode and drops it otherwise
    history = user + [{"role": "assistant", "content": "", "reasoning_content": why, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(result)}]
    reasoning = f"The tool returned {json.dumps(result)}. Report it to the user."
    return make_sample(rng, f"tools.answer.{name}", history, reasoning, answer, answer, tools=tools)

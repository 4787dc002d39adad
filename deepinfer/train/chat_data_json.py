"""JSON-answer chat samples: simple requests whose answer is one JSON value, computed from the question.

A third of them use ``response_format: json_object`` (the recipe then adds its JSON system
instruction), so the model learns both the plain request and the JSON-mode prompt.
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable

from deepinfer.train.chat_data import ChatSample, make_sample
from deepinfer.train.chat_data_math import ITEMS, PEOPLE

__all__ = ["JSON_TASKS", "make_json"]

CITIES = ("Paris", "Lagos", "Lima", "Oslo", "Cairo", "Tokyo", "Toronto", "Madrid", "Nairobi", "Hanoi",
          "Berlin", "Quito", "Dublin", "Seoul", "Lisbon", "Delhi", "Vienna", "Santiago", "Accra", "Prague")
FRUIT_COLOURS = {"banana": "yellow", "apple": "red", "lime": "green", "orange": "orange", "plum": "purple",
                 "blueberry": "blue", "cherry": "red", "kiwi": "brown", "lemon": "yellow", "grape": "green"}
PETS = ("dog", "cat", "rabbit", "parrot", "hamster", "goldfish", "turtle")


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def _person(rng: random.Random) -> tuple[str, Any, str]:
    name, age, city = rng.choice(PEOPLE)[0], rng.randint(18, 90), rng.choice(CITIES)
    q = rng.choice(("Give me a JSON object for a person named {n}, aged {a}, who lives in {c}.",
                    "Write JSON with the fields name, age and city for {n} ({a}, {c}).",
                    "Make a JSON record: {n} is {a} years old and lives in {c}."))
    return q.format(n=name, a=age, c=city), {"name": name, "age": age, "city": city}, \
        "The object needs the keys name, age and city; age is a number."


def _evens(rng: random.Random) -> tuple[str, Any, str]:
    nums = [rng.randint(0, 99) for _ in range(rng.randint(4, 10))]
    evens = [n for n in nums if n % 2 == 0]
    return f"List the even numbers in {nums} as a JSON array.", evens, \
        "Keep the numbers divisible by 2, in order: " + (", ".join(map(str, evens)) or "none") + "."


def _sum_product(rng: random.Random) -> tuple[str, Any, str]:
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    return f"Return a JSON object with the sum and the product of {a} and {b}.", \
        {"sum": a + b, "product": a * b}, f"{a} + {b} = {a + b} and {a} x {b} = {a * b}."


def _pairs(rng: random.Random) -> tuple[str, Any, str]:
    pet, name, count = rng.choice(PETS), rng.choice(PEOPLE)[0], rng.randint(1, 5)
    obj = {"owner": name, "pet": pet, "count": count}
    return f"Convert to JSON: owner: {name}; pet: {pet}; count: {count}", obj, \
        "Each 'key: value' pair becomes a field; count is a number."


def _prime(rng: random.Random) -> tuple[str, Any, str]:
    n = rng.randint(2, 200)
    divisor = next((d for d in range(2, int(n ** 0.5) + 1) if n % d == 0), None)
    why = f"{n} = {divisor} x {n // divisor}, so it is not prime." if divisor else \
        f"No number from 2 to {int(n ** 0.5)} divides {n}, so it is prime." if n > 3 else f"{n} is prime."
    return f"Answer in JSON: is {n} a prime number?", {"number": n, "is_prime": _is_prime(n)}, why


def _word_stats(rng: random.Random) -> tuple[str, Any, str]:
    word = rng.choice(ITEMS + tuple(FRUIT_COLOURS) + CITIES).split()[0].lower()
    vowels = sum(ch in "aeiou" for ch in word)
    return f"Give the length and the number of vowels of the word \"{word}\" as JSON.", \
        {"word": word, "length": len(word), "vowels": vowels}, \
        f"\"{word}\" has {len(word)} letters; its vowels are {[c for c in word if c in 'aeiou']}."


def _fruits(rng: random.Random) -> tuple[str, Any, str]:
    picked = rng.sample(sorted(FRUIT_COLOURS), rng.randint(2, 4))
    return f"Make a JSON list of these fruits with their usual colour: {', '.join(picked)}.", \
        [{"fruit": f, "colour": FRUIT_COLOURS[f]} for f in picked], \
        "One object per fruit with the keys fruit and colour."


JSON_TASKS: dict[str, Callable[[random.Random], tuple[str, Any, str]]] = {
    "person": _person, "evens": _evens, "sum_product": _sum_product, "pairs": _pairs, "prime": _prime,
    "word_stats": _word_stats, "fruits": _fruits}


def make_json(rng: random.Random) -> ChatSample:
    """One JSON-answer sample (compact, indented or fenced JSON; JSON mode for a third)."""
    name = rng.choice(sorted(JSON_TASKS))
    question, value, why = JSON_TASKS[name](rng)
    json_mode = rng.random() < 1 / 3
    style = rng.random()
    text = json.dumps(value, indent=2) if style < 0.4 else json.dumps(value)
    if not json_mode and style > 0.8:
        text = f"```json\n{text}\n```"
    messages = [{"role": "user", "content": question}]
    return make_sample(rng, f"json.{name}", messages, why, text, text, system_p=0.0 if json_mode else 0.3,
                       json_mode=json_mode)

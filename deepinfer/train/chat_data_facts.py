"""Short question-and-answer chat samples: small fact tables, word and number puzzles, tiny Python.

Facts come from short tables written here (capitals, plurals, opposites, colour mixing);
everything else (reversed words, letter counts, sorting, conversions) is computed.
"""

from __future__ import annotations

import calendar
import random
from typing import Callable

from deepinfer.train.chat_data import ChatSample, make_sample
from deepinfer.train.chat_data_json import CITIES, FRUIT_COLOURS
from deepinfer.train.chat_data_math import ITEMS

__all__ = ["FACT_TASKS", "make_fact"]

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
            "Egypt": "Cairo", "Canada": "Ottawa", "Spain": "Madrid", "Vietnam": "Hanoi", "Germany": "Berlin",
            "Ecuador": "Quito", "Ireland": "Dublin", "Portugal": "Lisbon", "India": "New Delhi",
            "Austria": "Vienna", "Chile": "Santiago", "Ghana": "Accra", "Italy": "Rome", "Brazil": "Brasilia",
            "Australia": "Canberra", "China": "Beijing", "Mexico": "Mexico City", "Argentina": "Buenos Aires",
            "Sweden": "Stockholm", "Finland": "Helsinki", "Greece": "Athens", "Turkey": "Ankara",
            "Poland": "Warsaw", "Morocco": "Rabat", "Nigeria": "Abuja", "Thailand": "Bangkok",
            "Indonesia": "Jakarta", "South Korea": "Seoul", "Denmark": "Copenhagen", "Hungary": "Budapest",
            "Cuba": "Havana", "Colombia": "Bogota", "Ethiopia": "Addis Ababa", "New Zealand": "Wellington"}
PLURALS = {"mouse": "mice", "child": "children", "foot": "feet", "tooth": "teeth", "person": "people",
           "goose": "geese", "leaf": "leaves", "knife": "knives", "box": "boxes", "city": "cities",
           "sheep": "sheep", "woman": "women", "cactus": "cacti", "fish": "fish", "bus": "buses"}
OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "open": "closed",
             "early": "late", "light": "dark", "up": "down", "full": "empty", "old": "new", "hard": "soft",
             "strong": "weak", "wet": "dry", "loud": "quiet", "first": "last"}
MIXES = {("blue", "yellow"): "green", ("red", "yellow"): "orange", ("red", "blue"): "purple",
         ("red", "white"): "pink", ("black", "white"): "grey"}
DAYS = tuple(calendar.day_name)
MONTHS = tuple(calendar.month_name)[1:]
GREETINGS = (("Hello!", "Hello! How can I help you today?"), ("Hi there.", "Hi! What would you like to know?"),
             ("Good morning!", "Good morning! What can I do for you?"),
             ("Thank you!", "You're welcome! Let me know if you need anything else."),
             ("Who are you?", "I am deepinfer-tiny, a small demo language model. I can answer simple "
                              "questions, do arithmetic step by step and reply in JSON."),
             ("What can you do?", "I can solve small arithmetic problems, answer simple questions, "
                                  "write short Python functions and give answers as JSON."))
WORDS = tuple(sorted({w for w in ITEMS if " " not in w} | set(FRUIT_COLOURS) | {c.lower() for c in CITIES}))
PY_FUNCS = (
    ("returns the sum of a list of numbers", "total", "def {f}(numbers):\n    result = 0\n    for n in numbers:\n"
     "        result += n\n    return result", "It adds each number to a running total."),
    ("returns the largest number in a list", "largest", "def {f}(numbers):\n    best = numbers[0]\n    for n in "
     "numbers[1:]:\n        if n > best:\n            best = n\n    return best", "It keeps the biggest value seen so far."),
    ("reverses a string", "reverse", "def {f}(text):\n    return text[::-1]", "A slice with step -1 walks the string backwards."),
    ("counts the vowels in a string", "count_vowels", "def {f}(text):\n    return sum(1 for ch in text.lower() "
     "if ch in \"aeiou\")", "It counts the characters that are vowels."),
    ("checks whether a number is even", "is_even", "def {f}(n):\n    return n % 2 == 0", "A number is even when dividing by 2 leaves no remainder."),
    ("computes the factorial of n", "factorial", "def {f}(n):\n    result = 1\n    for k in range(2, n + 1):\n"
     "        result *= k\n    return result", "It multiplies 1 x 2 x ... x n."),
    ("converts Celsius to Fahrenheit", "to_fahrenheit", "def {f}(celsius):\n    return celsius * 9 / 5 + 32",
     "Multiply by 9/5, then add 32."),
)


def _capital(rng: random.Random) -> tuple[str, str, str]:
    country = rng.choice(sorted(CAPITALS))
    return rng.choice(("What is the capital of {c}?", "Which city is the capital of {c}?")).format(c=country), \
        f"The capital of {country} is {CAPITALS[country]}.", f"The capital of {country} is {CAPITALS[country]}."


def _reverse(rng: random.Random) -> tuple[str, str, str]:
    w = rng.choice(WORDS)
    return f"Spell the word \"{w}\" backwards.", f"\"{w}\" backwards is \"{w[::-1]}\".", \
        f"Letters of \"{w}\": {' '.join(w)}. Reversed: {' '.join(reversed(w))}."


def _letters(rng: random.Random) -> tuple[str, str, str]:
    w, ch = rng.choice(WORDS), rng.choice("aeiorstn")
    n = w.count(ch)
    return f"How many times does the letter \"{ch}\" appear in \"{w}\"?", \
        f"The letter \"{ch}\" appears {n} time{'s' if n != 1 else ''} in \"{w}\".", \
        f"Letters: {' '.join(w)}. Count of \"{ch}\": {n}."


def _sort(rng: random.Random) -> tuple[str, str, str]:
    if rng.random() < 0.5:
        words = rng.sample(WORDS, rng.randint(3, 6))
        return f"Sort these words alphabetically: {', '.join(words)}.", ", ".join(sorted(words)), \
            "Compare the words letter by letter from the first letter."
    nums = [rng.randint(-50, 200) for _ in range(rng.randint(3, 8))]
    return f"Sort from smallest to largest: {', '.join(map(str, nums))}.", ", ".join(map(str, sorted(nums))), \
        f"The smallest is {min(nums)} and the largest is {max(nums)}."


def _calendar(rng: random.Random) -> tuple[str, str, str]:
    if rng.random() < 0.5:
        i, k = rng.randrange(7), rng.randint(1, 10)
        return f"If today is {DAYS[i]}, what day is it in {k} day{'s' if k > 1 else ''}?", \
            f"It will be {DAYS[(i + k) % 7]}.", f"Count {k} days on from {DAYS[i]}: {k} mod 7 = {k % 7}."
    m = rng.randrange(12)
    days = calendar.monthrange(2025, m + 1)[1]
    return f"How many days are there in {MONTHS[m]} 2025?", f"{MONTHS[m]} 2025 has {days} days.", \
        f"{MONTHS[m]} is month {m + 1}; 2025 is not a leap year."


def _compare(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.sample(range(1, 1000), 2)
    if rng.random() < 0.5:
        return f"Which is larger, {a} or {b}?", f"{max(a, b)} is larger than {min(a, b)}.", \
            f"{max(a, b)} - {min(a, b)} = {abs(a - b)}, which is positive."
    return f"Is {a} even or odd?", f"{a} is {'even' if a % 2 == 0 else 'odd'}.", \
        f"{a} ends in {a % 10}, and {a % 10} is {'even' if a % 2 == 0 else 'odd'}."


def _convert(rng: random.Random) -> tuple[str, str, str]:
    unit, small, factor = rng.choice((("kilometres", "metres", 1000), ("hours", "minutes", 60),
                                      ("kilograms", "grams", 1000), ("minutes", "seconds", 60),
                                      ("metres", "centimetres", 100), ("days", "hours", 24)))
    n = rng.randint(1, 50)
    return f"Convert {n} {unit} to {small}.", f"{n} {unit} is {n * factor} {small}.", \
        f"One {unit[:-1]} is {factor} {small}, so {n} x {factor} = {n * factor}."


def _words(rng: random.Random) -> tuple[str, str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        w = rng.choice(sorted(PLURALS))
        return f"What is the plural of \"{w}\"?", f"The plural of \"{w}\" is \"{PLURALS[w]}\".", \
            f"\"{w}\" has an irregular or spelling-rule plural." if PLURALS[w] != w + "s" else "Add s."
    if kind == 1:
        w = rng.choice(sorted(OPPOSITES))
        return f"What is the opposite of \"{w}\"?", f"The opposite of \"{w}\" is \"{OPPOSITES[w]}\".", \
            f"\"{w}\" and \"{OPPOSITES[w]}\" are antonyms."
    (c1, c2), mix = rng.choice(sorted(MIXES.items()))
    if rng.random() < 0.5:
        c1, c2 = c2, c1
    return f"What colour do you get when you mix {c1} and {c2} paint?", f"Mixing {c1} and {c2} gives {mix}.", \
        f"{c1.capitalize()} and {c2} paint make {mix}."


def _python(rng: random.Random) -> tuple[str, str, str]:
    what, default_name, body, why = rng.choice(PY_FUNCS)
    name = default_name if rng.random() < 0.7 else rng.choice(("solve", "compute", "helper", "func"))
    code = body.format(f=name)
    return f"Write a Python function called {name} that {what}.", f"```python\n{code}\n```\n\n{why}", \
        f"I need a function named {name} that {what}. {why}"


def _greeting(rng: random.Random) -> tuple[str, str, str]:
    q, a = rng.choice(GREETINGS)
    return q, a, "The user is greeting me or asking about me; answer politely and briefly."


FACT_TASKS: dict[str, Callable[[random.Random], tuple[str, str, str]]] = {
    "capital": _capital, "reverse": _reverse, "letters": _letters, "sort": _sort, "calendar": _calendar,
    "compare": _compare, "convert": _convert, "words": _words, "python": _python, "greeting": _greeting}


def make_fact(rng: random.Random) -> ChatSample:
    """One short Q&A sample (the answer is the same in both modes; thinking adds the reasoning)."""
    name = rng.choice(sorted(FACT_TASKS))
    question, answer, reasoning = FACT_TASKS[name](rng)
    return make_sample(rng, f"facts.{name}", [{"role": "user", "content": question}], reasoning, answer, answer)

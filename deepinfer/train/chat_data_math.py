"""Arithmetic chat samples: word problems and bare sums with worked steps that are always right.

Every number in a question is drawn from the seeded ``rng`` and every answer is computed,
so the steps a model learns from are correct by construction.
"""

from __future__ import annotations

import random
from typing import Callable

from deepinfer.train.chat_data import ChatSample, make_sample

__all__ = ["MATH_TASKS", "make_math", "PEOPLE", "ITEMS"]

PEOPLE = (("Tom", "he"), ("Anna", "she"), ("Ravi", "he"), ("Mei", "she"), ("Lucas", "he"), ("Sara", "she"),
          ("Omar", "he"), ("Elena", "she"), ("Kenji", "he"), ("Aisha", "she"), ("Noah", "he"),
          ("Lena", "she"), ("Diego", "he"), ("Priya", "she"), ("Jonas", "he"), ("Fatima", "she"),
          ("Sam", "they"), ("Alex", "they"), ("Hugo", "he"), ("Ines", "she"), ("Kofi", "he"), ("Yuki", "she"))
ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "coins", "cards",
         "shells", "eggs", "oranges", "balloons", "crayons", "toy cars", "beads", "buttons", "seeds")
GOODS = (("notebook", 3), ("sandwich", 5), ("ticket", 12), ("pen", 2), ("mug", 7), ("plant", 9),
         ("T-shirt", 15), ("book", 11), ("bottle of juice", 4), ("box of tea", 6))


def _verb(pronoun: str, singular: str, plural: str) -> str:
    return plural if pronoun == "they" else singular


def _person(rng: random.Random) -> tuple[str, str]:
    return rng.choice(PEOPLE)


def _buy_more(rng: random.Random) -> tuple[str, list[str], str, str]:
    (name, he), item = _person(rng), rng.choice(ITEMS)
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    q = (f"{name} has {a} {item}. {he.capitalize()} {_verb(he, 'gets', 'get')} {b} more. "
         f"How many {item} does {name} have now?")
    return q, [f"{name} starts with {a} {item} and gets {b} more.", f"{a} + {b} = {a + b}."], \
        f"{name} has {a + b} {item} now.", str(a + b)


def _give_away(rng: random.Random) -> tuple[str, list[str], str, str]:
    (name, he), item = _person(rng), rng.choice(ITEMS)
    b = rng.randint(1, 40)
    a = b + rng.randint(1, 60)
    q = f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} are left?"
    return q, [f"{name} had {a} {item} and gave away {b}.", f"{a} - {b} = {a - b}."], \
        f"{name} has {a - b} {item} left.", str(a - b)


def _packs(rng: random.Random) -> tuple[str, list[str], str, str]:
    (name, he), item = _person(rng), rng.choice(ITEMS)
    n, k = rng.randint(2, 12), rng.randint(2, 25)
    q = f"{name} buys {n} packs of {item}. Each pack has {k} {item}. How many {item} is that in total?"
    return q, [f"There are {n} packs with {k} {item} in each.", f"{n} x {k} = {n * k}."], \
        f"That is {n * k} {item} in total.", str(n * k)


def _share(rng: random.Random) -> tuple[str, list[str], str, str]:
    item, friends = rng.choice(ITEMS), rng.randint(2, 9)
    total = friends * rng.randint(1, 15) + rng.randint(0, friends - 1)
    each, left = divmod(total, friends)
    q = f"{total} {item} are shared equally among {friends} friends. How many does each friend get, " \
        "and how many are left over?"
    steps = [f"Divide {total} by {friends}.", f"{friends} x {each} = {friends * each}, and "
             f"{total} - {friends * each} = {left}.", f"So {total} / {friends} = {each} remainder {left}."]
    return q, steps, f"Each friend gets {each} {item}, and {left} {'is' if left == 1 else 'are'} left over.", \
        f"{each} each, {left} left"


def _two_step(rng: random.Random) -> tuple[str, list[str], str, str]:
    (name, he), item = _person(rng), rng.choice(ITEMS)
    a, n, k = rng.randint(1, 30), rng.randint(2, 6), rng.randint(2, 12)
    d = rng.randint(1, a + n * k - 1)
    total = a + n * k
    q = (f"{name} has {a} {item}. {he.capitalize()} {_verb(he, 'buys', 'buy')} {n} bags with {k} {item} "
         f"each, then {_verb(he, 'gives', 'give')} away {d}. How many {item} does {name} have now?")
    steps = [f"The bags hold {n} x {k} = {n * k} {item}.", f"With the first {a}: {a} + {n * k} = {total}.",
             f"After giving away {d}: {total} - {d} = {total - d}."]
    return q, steps, f"{name} has {total - d} {item} now.", str(total - d)


def _change(rng: random.Random) -> tuple[str, list[str], str, str]:
    (name, he), (good, price) = _person(rng), rng.choice(GOODS)
    n = rng.randint(1, 6)
    cost = n * price
    paid = next(v for v in (5, 10, 20, 50, 100, 200) if v > cost)
    q = f"A {good} costs {price} dollars. {name} buys {n} and pays with a {paid}-dollar note. " \
        "How much change does " + ("they" if he == "they" else name) + " get?"
    steps = [f"The cost is {n} x {price} = {cost} dollars.", f"The change is {paid} - {cost} = {paid - cost} dollars."]
    return q, steps, f"{name} gets {paid - cost} dollars in change.", f"{paid - cost} dollars"


def _bare(rng: random.Random) -> tuple[str, list[str], str, str]:
    op = rng.choice("+-x")
    a, b = rng.randint(10, 999), rng.randint(2, 99 if op == "x" else 999)
    if op == "-" and b > a:
        a, b = b, a
    if op == "+":
        result, steps = a + b, [f"{a} + {b} = {a + b}."]
    elif op == "-":
        result, steps = a - b, [f"{a} - {b} = {a - b}."]
    else:
        tens, ones = b // 10 * 10, b % 10
        result = a * b
        steps = [f"Split {b} into {tens} + {ones}.", f"{a} x {tens} = {a * tens} and {a} x {ones} = {a * ones}.",
                 f"{a * tens} + {a * ones} = {result}."] if tens and ones else [f"{a} x {b} = {result}."]
    sym = "*" if op == "x" and rng.random() < 0.5 else op
    steps = [s.replace(" x ", f" {sym} ") for s in steps]
    q = rng.choice(("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}, please.",
                    "{a} {op} {b} = ?")).format(a=a, op=sym, b=b)
    return q, steps, f"{a} {sym} {b} = {result}.", str(result)


def _percent(rng: random.Random) -> tuple[str, list[str], str, str]:
    pct = rng.choice((10, 20, 25, 50, 75, 5, 30, 40))
    base = rng.randint(1, 40) * 20
    value = base * pct // 100
    q = f"What is {pct}% of {base}?"
    return q, [f"{pct}% means {pct} per 100.", f"{base} x {pct} / 100 = {base * pct} / 100 = {value}."], \
        f"{pct}% of {base} is {value}.", str(value)


def _clock(rng: random.Random) -> tuple[str, list[str], str, str]:
    h, m = rng.randint(6, 14), rng.choice(range(0, 60, 5))
    dh, dm = rng.randint(0, 5), rng.choice(range(5, 60, 5))
    end = (h * 60 + m + dh * 60 + dm) % (24 * 60)
    start_s, end_s = f"{h}:{m:02d}", f"{end // 60}:{end % 60:02d}"
    q = f"A train leaves at {start_s} and the trip takes {dh} hours and {dm} minutes. When does it arrive?"
    steps = [f"Start at {start_s}.", f"Add {dh} hours: {(h + dh) % 24}:{m:02d}.",
             f"Add {dm} minutes: {end_s}."]
    return q, steps, f"The train arrives at {end_s}.", end_s


MATH_TASKS: dict[str, Callable[[random.Random], tuple[str, list[str], str, str]]] = {
    "buy_more": _buy_more, "give_away": _give_away, "packs": _packs, "share": _share,
    "two_step": _two_step, "change": _change, "bare": _bare, "percent": _percent, "clock": _clock}


def make_math(rng: random.Random) -> ChatSample:
    """One arithmetic sample; a quarter of them are a follow-up turn on an earlier problem."""
    name = rng.choice(sorted(MATH_TASKS))
    question, steps, sentence, short = MATH_TASKS[name](rng)
    messages = [{"role": "user", "content": question}]
    if rng.random() < 0.25:  # a finished earlier turn as history, then this question
        q0, s0, sent0, _ = MATH_TASKS[rng.choice(sorted(MATH_TASKS))](rng)
        messages = [{"role": "user", "content": q0}, {"role": "assistant", "content": sent0},
                    {"role": "user", "content": rng.choice(("Thanks. Another one: ", "Now this: ", "")) + question}]
    reasoning = "\n".join(steps)
    worked = "\n".join(steps) + f"\n\nSo the answer is {short}. {sentence}"
    return make_sample(rng, f"math.{name}", messages, reasoning, sentence, worked)

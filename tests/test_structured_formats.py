"""The calendar formats are compiled as exact patterns: equal to jsonschema's format checker
(RFC 3339, no leap seconds, T/Z in either case) on strings of each format's shape."""

from __future__ import annotations

import random
import re

import jsonschema

from deepinfer.structured.patterns import DATE_PATTERN, DATE_TIME_PATTERN, TIME_PATTERN

CHECK = jsonschema.Draft202012Validator.FORMAT_CHECKER


def _time(rng: random.Random) -> str:
    frac = rng.choice(["", "." + str(rng.randrange(10**rng.randrange(1, 4)))])
    zone = rng.choice(["Z", "z", f"{rng.choice('+-')}{rng.randrange(26):02d}:{rng.randrange(62):02d}"])
    return f"{rng.randrange(26):02d}:{rng.randrange(62):02d}:{rng.randrange(62):02d}{frac}{zone}"


def _date(rng: random.Random) -> str:
    return f"{rng.choice([0, 1, 4, 100, 1900, 2000, 2023, 2024, 9999, rng.randrange(10000)]):04d}-" \
           f"{rng.randrange(14):02d}-{rng.randrange(33):02d}"


def test_patterns_equal_the_format_checker(fresh_seed: int) -> None:
    rng = random.Random(fresh_seed)
    for fmt, pattern, make in (("date", DATE_PATTERN, _date), ("time", TIME_PATTERN, _time),
                               ("date-time", DATE_TIME_PATTERN,
                                lambda r: _date(r) + r.choice("Tt") + _time(r))):
        seen = {True: 0, False: 0}
        for _ in range(3000):
            s = make(rng)
            expected = CHECK.conforms(s, fmt)
            assert (re.fullmatch(pattern, s) is not None) == expected, f"{fmt} seed={fresh_seed}: {s!r}"
            seen[expected] += 1
        assert min(seen.values()) > 100, (fmt, seen)  # both outcomes were exercised
    for leap_second in ("23:59:60Z", "2016-12-31T23:59:60Z"):  # RFC 3339 syntax, but the checker says no
        assert not re.fullmatch(TIME_PATTERN if "T" not in leap_second else DATE_TIME_PATTERN, leap_second)

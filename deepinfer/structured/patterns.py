"""Exact regexes for the calendar formats, compiled instead of the backends' own grammars.

xgrammar's date grammar allows day 31 in every month and Feb 29 in every year, and both
backends' ``date-time`` / ``time`` allow second 60 in every minute; jsonschema's format
checker (RFC 3339 through ``rfc3339_validator``, no leap seconds, letters ``T`` / ``Z`` in
either case) rejects those. These patterns accept exactly what that checker accepts on
strings of the format's shape (tested in tests/test_structured_formats.py):

* ``date``: ``YYYY-MM-DD``, Gregorian calendar, years 0001-9999;
* ``time``: ``HH:MM:SS``, optional fraction, then ``Z`` or a ``+HH:MM`` / ``-HH:MM`` offset;
* ``date-time``: a date, ``T``, a time.
"""

from __future__ import annotations

__all__ = ["DATE_PATTERN", "TIME_PATTERN", "DATE_TIME_PATTERN"]

_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (r"(?:" + _YEAR + r"-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
         r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))|" + _LEAP_YEAR + r"-02-29)")
_HOUR = r"(?:[01][0-9]|2[0-3])"
_TIME = _HOUR + r":[0-5][0-9]:[0-5][0-9](?:[.][0-9]+)?(?:[Zz]|[+-]" + _HOUR + r":[0-5][0-9])"

DATE_PATTERN = "^" + _DATE + "$"
TIME_PATTERN = "^" + _TIME + "$"
DATE_TIME_PATTERN = "^" + _DATE + "[Tt]" + _TIME + "$"

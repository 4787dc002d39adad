"""Where a JSON schema holds subschemas (the keys xgrammar's check walks, ``checks.py``;
``schema_counts.py`` walks these and the ones xgrammar ignores)."""

from __future__ import annotations

SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems",
             "additionalItems")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")

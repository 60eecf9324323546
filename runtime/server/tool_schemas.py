"""Checking the JSON Schemas of a request's tools, once per distinct schema.

Clients send the same tools with every request of a session, and a metaschema check is costly work
on the event loop (it was ~9% of the server's CPU samples under the 80-session gate), so each
verdict is kept by the SHA-256 of the schema's canonical JSON, in a bounded LRU table: a repeated
schema costs one serialisation and one hash, never a second check.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

CACHE_ENTRIES = 1024


class SchemaVerdicts:
    def __init__(self, capacity: int = CACHE_ENTRIES) -> None:
        self.capacity = capacity
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # digest -> error, None when valid
        self.checks = 0  # metaschema checks run (what the cache saves)

    def error(self, schema: dict[str, Any]) -> str | None:
        """Why `schema` is not a usable tool-parameters schema, or None."""
        key = hashlib.sha256(json.dumps(schema, sort_keys=True, separators=(",", ":")).encode()).digest()
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            return self._verdicts[key]
        verdict = self._check(schema)
        self._verdicts[key] = verdict
        if len(self._verdicts) > self.capacity:
            self._verdicts.popitem(last=False)
        return verdict

    def _check(self, schema: dict[str, Any]) -> str | None:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        self.checks += 1
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as exc:
            return f"invalid JSON Schema: {exc.message}"
        if schema.get("type", "object") != "object":
            return "must be a JSON Schema of type object"
        return None


VERDICTS = SchemaVerdicts()

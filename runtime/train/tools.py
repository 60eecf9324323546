"""The canary tool set: OpenAI-format tool definitions with JSON Schemas, and their local executor.

Tools are pure functions of their arguments (results derive from a hash of the canonical argument
JSON), so a harness can execute them locally and every run of a session sees the same results.
The parameter types cover what a tool-call parser must get right: strings, integers, numbers,
enums, booleans and arrays.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD"]
# Units per USD; fixed so conversions are reproducible.
USD_RATE = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.2, "CHF": 0.88, "CAD": 1.36}
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
ORDER_STATUS = ["shipped", "pending", "delivered", "cancelled"]
PRODUCT_WORDS = ["classic", "compact", "deluxe", "rugged", "silent", "smart", "travel", "vintage"]


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


TOOLS: list[dict[str, Any]] = [
    _tool("get_weather", "Current weather for a city.",
          {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
          ["city", "unit"]),
    _tool("convert_currency", "Convert an amount between currencies.",
          {"amount": {"type": "number"}, "from_currency": {"type": "string", "enum": CURRENCIES},
           "to_currency": {"type": "string", "enum": CURRENCIES}},
          ["amount", "from_currency", "to_currency"]),
    _tool("lookup_order", "Status of an order.",
          {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"}, "include_items": {"type": "boolean"}},
          ["order_id", "include_items"]),
    _tool("schedule_meeting", "Book a meeting.",
          {"person": {"type": "string"}, "day": {"type": "string", "enum": DAYS},
           "hour": {"type": "integer", "minimum": 8, "maximum": 18},
           "duration_min": {"type": "integer", "minimum": 15, "maximum": 120}},
          ["person", "day", "hour", "duration_min"]),
    _tool("search_products", "Search the product catalog.",
          {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
           "tags": {"type": "array", "items": {"type": "string"}}},
          ["query", "max_results", "tags"]),
    _tool("send_message", "Send a short message to a person.",
          {"recipient": {"type": "string"}, "text": {"type": "string"}, "urgent": {"type": "boolean"}},
          ["recipient", "text", "urgent"]),
    _tool("compute_stats", "Sum and mean of a list of numbers.",
          {"values": {"type": "array", "items": {"type": "number"}}},
          ["values"]),
]

TOOL_NAMES = [t["function"]["name"] for t in TOOLS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _digest(name: str, args: dict[str, Any]) -> int:
    blob = json.dumps([name, args], sort_keys=True).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "big")


def _code(prefix: str, h: int) -> str:
    alphabet = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
    return prefix + "".join(alphabet[(h >> (5 * i)) % 32] for i in range(4))


def execute(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run a tool locally. Raises KeyError/TypeError on unknown tools or malformed arguments."""
    h = _digest(name, args)
    if name == "get_weather":
        celsius = h % 41 - 5
        temp = celsius if args["unit"] == "celsius" else round(celsius * 9 / 5 + 32)
        return {"city": args["city"], "temperature": temp, "condition": CONDITIONS[(h >> 8) % len(CONDITIONS)]}
    if name == "convert_currency":
        usd = args["amount"] / USD_RATE[args["from_currency"]]
        return {"result": round(usd * USD_RATE[args["to_currency"]], 2)}
    if name == "lookup_order":
        out: dict[str, Any] = {"order_id": args["order_id"], "status": ORDER_STATUS[h % len(ORDER_STATUS)]}
        if args["include_items"]:
            out["items"] = 1 + (h >> 8) % 9
        return out
    if name == "schedule_meeting":
        return {"confirmation": _code("MTG-", h)}
    if name == "search_products":
        count = 1 + h % args["max_results"]
        return {"count": count, "top": PRODUCT_WORDS[(h >> 8) % len(PRODUCT_WORDS)] + " " + args["query"]}
    if name == "send_message":
        return {"message_id": _code("MSG-", h), "delivered": True}
    if name == "compute_stats":
        values = args["values"]
        return {"sum": round(sum(values), 2), "mean": round(sum(values) / len(values), 2)}
    raise KeyError(f"unknown tool {name!r}")

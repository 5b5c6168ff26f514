"""The JSON schemas the structured-output tests constrain to, and the grammar benchmark compiles.

Between them they use enums, string patterns, nested objects, arrays with min/max items,
booleans, integers and numbers with bounds: a small model left unconstrained rarely writes
any of them validly, so an output that validates shows the constraint at work.
"""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "enum_and_boolean": {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "bright": {"type": "boolean"},
        },
        "required": ["color", "bright"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        },
        "required": ["zip", "code"],
        "additionalProperties": False,
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "floor": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["city", "floor"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_min_max_items": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["a", "b", "c", "d"]},
                "minItems": 2,
                "maxItems": 4,
            },
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "count": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        "required": ["price", "count"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "people": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "age": {"type": "integer", "minimum": 0, "maximum": 120},
                        "admin": {"type": "boolean"},
                        "role": {"type": "string", "enum": ["dev", "ops"]},
                    },
                    "required": ["age", "admin", "role"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["people"],
        "additionalProperties": False,
    },
}

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

"""32 JSON schemas of the kinds structured-output users send, each with what a prompt asks for: nested objects,
bounded arrays, enums, anyOf, patterns, bounded numbers, required and optional properties (benchmarks.structured
and tests/jvllm/test_structured_outputs.py)."""
from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 120}},
                  "required": ["name", "age"], "additionalProperties": False}),
    ("a city with its country", {"type": "object", "properties": {"city": NAME, "country": NAME},
                                 "required": ["city", "country"], "additionalProperties": False}),
    ("a list of three colours", {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3,
                                 "maxItems": 3}),
    ("a yes or no answer", {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                            "required": ["answer"], "additionalProperties": False}),
    ("a temperature reading", {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50,
                                                                            "maximum": 60}},
                               "required": ["celsius"], "additionalProperties": False}),
    ("a book", {"type": "object", "properties": {
        "title": NAME, "author": NAME, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science", "poetry"]},
                   "minItems": 1, "maxItems": 2}},
        "required": ["title", "author", "year", "genres"], "additionalProperties": False}),
    ("a phone contact", {"type": "object", "properties": {
        "name": NAME, "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
        "required": ["name", "phone"], "additionalProperties": False}),
    ("a point in 2D", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                                                        "y": {"type": "integer", "minimum": -10, "maximum": 10}},
                       "required": ["x", "y"], "additionalProperties": False}),
    ("a boolean flag", {"type": "object", "properties": {"enabled": {"type": "boolean"}}, "required": ["enabled"],
                        "additionalProperties": False}),
    ("an id that is either a number or a short code", {
        "type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999},
                                                          {"type": "string", "pattern": "^[A-Z]{3}$"}]}},
        "required": ["id"], "additionalProperties": False}),
    ("an order with items", {"type": "object", "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 100000},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["order_id", "items"], "additionalProperties": False}),
    ("a weekday", {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}),
    ("a rating from 1 to 5", {"type": "integer", "minimum": 1, "maximum": 5}),
    ("a short greeting", {"type": "string", "minLength": 2, "maxLength": 30}),
    ("an address", {"type": "object", "properties": {
        "street": NAME, "number": {"type": "integer", "minimum": 1, "maximum": 999},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": {"enum": ["FR", "DE", "IT", "ES"]}},
        "required": ["street", "number", "zip", "country"], "additionalProperties": False}),
    ("a user with an optional nickname", {"type": "object", "properties": {"name": NAME, "nickname": NAME},
                                          "required": ["name"], "additionalProperties": False}),
    ("a matrix of two rows of two numbers", {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    ("a product with a price", {"type": "object", "properties": {
        "product": NAME, "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
        "currency": {"const": "EUR"}}, "required": ["product", "price", "currency"], "additionalProperties": False}),
    ("an HTTP status", {"type": "object", "properties": {"code": {"enum": [200, 201, 400, 404, 500]},
                                                         "ok": {"type": "boolean"}},
                        "required": ["code", "ok"], "additionalProperties": False}),
    ("a list of up to four tags", {"type": "array", "maxItems": 4, "items": {"type": "string",
                                                                              "pattern": "^[a-z]{2,8}$"}}),
    ("a movie review", {"type": "object", "properties": {
        "movie": NAME, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 40}}, "required": ["movie", "stars", "summary"],
        "additionalProperties": False}),
    ("an event with a date", {"type": "object", "properties": {
        "event": NAME, "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["event", "date"], "additionalProperties": False}),
    ("a nested company record", {"type": "object", "properties": {
        "company": NAME, "ceo": {"type": "object", "properties": {"name": NAME, "since": {
            "type": "integer", "minimum": 1900, "maximum": 2030}}, "required": ["name", "since"],
            "additionalProperties": False}}, "required": ["company", "ceo"], "additionalProperties": False}),
    ("a shape that is a circle or a square", {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 50}},
         "required": ["kind", "radius"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 50}},
         "required": ["kind", "side"], "additionalProperties": False}]}),
    ("the first three prime numbers", {"type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 97},
                                       "minItems": 3, "maxItems": 3}),
    ("the share of the Earth covered by water, in percent", {"type": "object", "properties": {"value": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5}},
                      "required": ["value"], "additionalProperties": False}),
    ("a language and whether it is compiled", {"type": "object", "properties": {
        "language": {"enum": ["Python", "Rust", "Go", "Java", "C"]}, "compiled": {"type": "boolean"}},
        "required": ["language", "compiled"], "additionalProperties": False}),
    ("a null or a name", {"type": "object", "properties": {"value": {"anyOf": [{"type": "null"}, NAME]}},
                          "required": ["value"], "additionalProperties": False}),
    ("a team of two people", {"type": "object", "properties": {"members": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "object", "properties": {"name": NAME, "role": {"enum": ["lead", "dev", "qa"]}},
            "required": ["name", "role"], "additionalProperties": False}}},
        "required": ["members"], "additionalProperties": False}),
    ("an RGB colour", {"type": "object", "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255}
                                                        for c in ("r", "g", "b")},
                       "required": ["r", "g", "b"], "additionalProperties": False}),
    ("a hex colour code", {"type": "string", "pattern": "^#[0-9a-f]{6}$"}),
    ("a to-do item with optional due day", {"type": "object", "properties": {
        "task": NAME, "done": {"type": "boolean"}, "due": {"enum": ["today", "tomorrow", "later"]}},
        "required": ["task", "done"], "additionalProperties": False}),
]

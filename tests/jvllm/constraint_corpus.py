"""A randomized corpus of output constraints (JSON schemas, regexes, choice lists, Lark grammars), each with an
independent check of an output: jsonschema, Python's re, list membership, the lark package's parser."""
from __future__ import annotations

import dataclasses
import json
import random
import re
import string
from typing import Callable

import jsonschema
import lark

from jvllm import StructuredOutputsParams


@dataclasses.dataclass
class Case:
    name: str
    constraint: StructuredOutputsParams
    holds: Callable[[str], bool]  # the output satisfies the constraint


def _word(rng: random.Random, low: int = 1, high: int = 6) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(low, high)))


# ---- JSON schemas: every branch bounded (maxLength, ranges, maxItems, no extra properties), so outputs end ----
def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "boolean", "enum", "const", "null", "pattern"]
    if depth < 3:
        kinds += ["object", "object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": f"^[a-c]{{1,{rng.randint(1, 4)}}}-[0-9]{{2}}$"}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": [_word(rng) for _ in range(rng.randint(1, 5))] + [rng.randint(0, 99)]}
    if kind == "const":
        return {"const": _word(rng)}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    names = rng.sample(["id", "name", "tags", "count", "ok", "kind", "note", "when"], rng.randint(1, 4))
    return {"type": "object", "properties": {name: random_schema(rng, depth + 1) for name in names},
            "required": rng.sample(names, rng.randint(0, len(names))), "additionalProperties": False}


def _json_holds(schema: dict) -> Callable[[str], bool]:
    def holds(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
            return True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
    return holds


# ---- regular expressions: the syntax Python's re and llguidance's (Rust) regex read alike ----
def random_regex(rng: random.Random) -> str:
    atoms = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["word", "class", "digits", "alternation", "optional"])
        if kind == "word":
            atoms.append(_word(rng, 1, 4))
        elif kind == "class":
            atoms.append(f"[a-{rng.choice('cfz')}]{{{rng.randint(1, 2)},{rng.randint(2, 5)}}}")
        elif kind == "digits":
            atoms.append(f"[0-9]{{{rng.randint(1, 4)}}}")
        elif kind == "alternation":
            atoms.append("(" + "|".join(_word(rng, 1, 3) for _ in range(rng.randint(2, 4))) + ")")
        else:
            atoms.append(f"( {_word(rng, 1, 3)})?")
    return rng.choice(["", "-", " ", ":"]).join(atoms)


# ---- choice lists: shared prefixes, regex metacharacters, up to 10^4 options ----
def random_choices(rng: random.Random, count: int) -> list[str]:
    prefix = rng.choice(["option number ", "", "item-", "(a|b) ", "x.y*"])
    choices = {f"{prefix}{i}" for i in range(count - 2)} | {_word(rng) + ".+?", "[" + _word(rng) + "]"}
    return sorted(choices)[:count]


# ---- Lark grammars: rules refer only to later rules, so every language is finite and outputs end ----
def random_grammar(rng: random.Random) -> str:
    count = rng.randint(1, 5)
    rules = []
    for index in range(count):
        alternatives = []
        for _ in range(rng.randint(1, 3)):
            parts = []
            for _ in range(rng.randint(1, 3)):
                later = [f"r{j}" for j in range(index + 1, count)]
                kind = rng.choice(["string", "regex"] + (["rule", "rule"] if later else []))
                if kind == "string":
                    parts.append(json.dumps(rng.choice([_word(rng), " ", ", ", "[", "]", "=", "\\n"])))
                elif kind == "regex":
                    parts.append(f"/[a-{rng.choice('dk')}0-9]{{1,{rng.randint(1, 4)}}}/")
                else:
                    parts.append(rng.choice(later))
            alternatives.append(" ".join(parts))
        rules.append(f"r{index}: " + " | ".join(alternatives))
    return "start: r0\n" + "\n".join(rules) + "\n"


def _grammar_holds(grammar: str) -> Callable[[str], bool]:
    parser = lark.Lark(grammar, start="start", parser="earley", lexer="dynamic")

    def holds(text: str) -> bool:
        try:
            parser.parse(text)
            return True
        except lark.exceptions.LarkError:
            return False
    return holds


def corpus(seed: int, *, schemas: int = 50, regexes: int = 40, grammars: int = 30,
           choice_sizes: tuple[int, ...] = (2, 3, 10, 100, 1_000, 10_000)) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(schemas):
        schema = random_schema(rng)
        cases.append(Case(f"json-{i}", StructuredOutputsParams(json=schema), _json_holds(schema)))
    for i in range(regexes):
        pattern = random_regex(rng)
        cases.append(Case(f"regex-{i}: {pattern}", StructuredOutputsParams(regex=pattern),
                          lambda text, p=re.compile(pattern): p.fullmatch(text) is not None))
    for size in choice_sizes:
        choices = random_choices(rng, size)
        cases.append(Case(f"choice-{size}", StructuredOutputsParams(choice=choices),
                          lambda text, members=frozenset(choices): text in members))
    for i in range(grammars):
        grammar = random_grammar(rng)
        cases.append(Case(f"grammar-{i}", StructuredOutputsParams(grammar=grammar), _grammar_holds(grammar)))
    return cases

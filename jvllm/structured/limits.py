"""Bounds on what one structured-output constraint may ask of the grammar compiler, checked before it runs."""
from __future__ import annotations

import dataclasses
import json
import re
import urllib.parse
from typing import Any

import llguidance

from jvllm.sampling_params import StructuredOutputsParams

# A rule or terminal definition at the start of a line: Lark's `name:` / `NAME.2:` / `?name:`, GBNF's `name ::=`.
_RULE_HEAD = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?:::=|:)", re.MULTILINE)
_STATE_DUMP = re.compile(r"<(state|non-verbose/|backtrace)>")


@dataclasses.dataclass(frozen=True)
class GrammarLimits:
    """What a constraint may cost. The size limits keep the compiler's work and stack small; the rest is
    llguidance's own parser budget (its defaults, with verbose errors off so no parser state reaches a client)."""

    max_bytes: int = 512 << 10  # a schema, regex, grammar or choice list, as UTF-8 text
    max_choices: int = 10_000
    max_rules: int = 2_000  # Lark / GBNF rule and terminal definitions
    max_schema_refs: int = 1_000  # "$ref"s in one JSON schema
    max_ref_depth: int = 128  # the longest chain of $refs, each found inside the definition the previous one names
    max_schema_depth: int = 256  # nesting of the schema document itself (objects and arrays)
    compile_timeout_s: float = 10.0  # one compile in the sandbox process
    compile_memory_bytes: int = 1 << 30  # the sandbox process's address space beyond what it holds at start
    sandbox_stack_bytes: int = 16 << 20  # its compile thread's stack: 1/16 of this process's compile thread
    max_items_in_row: int = 2_000  # llguidance: Earley items of one row (alternatives alive at once)
    step_max_items: int = 50_000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    max_lexer_states: int = 250_000
    max_grammar_size: int = 500_000

    def parser_settings(self) -> dict[str, Any]:
        """llguidance.LLParserLimits keyword arguments (plain values: they cross to the sandbox process)."""
        return dict(max_items_in_row=self.max_items_in_row, step_max_items=self.step_max_items,
                    initial_lexer_fuel=self.initial_lexer_fuel, step_lexer_fuel=self.step_lexer_fuel,
                    max_lexer_states=self.max_lexer_states, max_grammar_size=self.max_grammar_size,
                    verbose_errors=False)

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(**self.parser_settings())


def constraint_value(params: StructuredOutputsParams) -> Any:
    """The constraint as plain JSON data (a schema given as text is parsed); ValueError for unreadable JSON."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (json.JSONDecodeError, RecursionError) as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema object")
        return schema
    return True if kind == "json_object" else getattr(params, kind)


def check_constraint(kind: str, value: Any, limits: GrammarLimits) -> None:
    """ValueError naming the field and the limit when a constraint is larger than the compiler may take."""
    field = f"structured_outputs.{kind}"
    if kind == "choice":
        if len(value) > limits.max_choices:
            raise ValueError(f"{field} has {len(value)} options; at most {limits.max_choices} are allowed")
        _check_bytes(field, sum(len(choice.encode()) for choice in value), limits)
    elif kind in ("regex", "grammar"):
        _check_bytes(field, len(value.encode()), limits)
        rules = len(_RULE_HEAD.findall(value)) if kind == "grammar" else 0
        if rules > limits.max_rules:
            raise ValueError(f"{field} defines {rules} rules; at most {limits.max_rules} are allowed")
    elif kind == "json":
        _check_schema(field, value, limits)


def _check_bytes(field: str, size: int, limits: GrammarLimits) -> None:
    if size > limits.max_bytes:
        raise ValueError(f"{field} is {size} bytes long; at most {limits.max_bytes} are allowed")


def _check_schema(field: str, schema: Any, limits: GrammarLimits) -> None:
    depth, refs = _document_shape(schema)
    if depth > limits.max_schema_depth:
        raise ValueError(f"{field} is nested {depth} levels deep; at most {limits.max_schema_depth} are allowed")
    _check_bytes(field, len(json.dumps(schema).encode()), limits)
    if refs > limits.max_schema_refs:
        raise ValueError(f"{field} has {refs} $refs; at most {limits.max_schema_refs} are allowed")
    chain = ref_chain_depth(schema)
    if chain > limits.max_ref_depth:
        raise ValueError(f"{field} chains $refs {chain} deep (a definition whose $ref names another, and so on); "
                         f"at most {limits.max_ref_depth} are allowed")


def _document_shape(document: Any) -> tuple[int, int]:
    """-> (nesting depth, number of "$ref" keys) of a JSON document, walked without recursion."""
    deepest, refs, stack = 0, 0, [(document, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            refs += "$ref" in node
            stack.extend((child, depth + 1) for child in node.values() if isinstance(child, (dict, list)))
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node if isinstance(child, (dict, list)))
    return deepest, refs


def ref_chain_depth(schema: Any) -> int:
    """The longest chain of local $refs from the root: each link is a $ref found inside the subschema the previous
    link names (definitions sections excluded: they are only reached through refs). Cycles, which are how a
    recursive schema is written, end a chain."""
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if expanded:
            on_path.discard(key)
            depth[key] = 1 + max((depth.get(id(t), 0) for t in _ref_targets(schema, node) if id(t) != key),
                                 default=0)
            continue
        if key in depth or key in on_path:
            continue
        on_path.add(key)
        stack.append((node, True))
        stack.extend((target, False) for target in _ref_targets(schema, node)
                     if id(target) not in depth and id(target) not in on_path)
    return depth.get(id(schema), 1) - 1


def _ref_targets(root: Any, node: Any) -> list[Any]:
    """The subschemas named by local $refs inside `node` (not inside its definitions sections)."""
    targets, stack = [], [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                target = _resolve_pointer(root, ref)
                if isinstance(target, (dict, list)):
                    targets.append(target)
            stack.extend(child for name, child in item.items()
                         if name not in ("$defs", "definitions") and isinstance(child, (dict, list)))
        elif isinstance(item, list):
            stack.extend(child for child in item if isinstance(child, (dict, list)))
    return targets


def _resolve_pointer(root: Any, ref: str) -> Any:
    """The node a local `#/a/b` reference names, or None (remote and unresolvable refs are the compiler's to
    refuse)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in urllib.parse.unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def plain_error(message: str, max_lines: int = 4, max_chars: int = 600) -> str:
    """llguidance's error text as a client may read it: no parser state dump, no native backtrace."""
    match = _STATE_DUMP.search(message)
    text = (message[:match.start()] if match else message).strip()
    if text.startswith("panic:"):
        text = "the grammar library failed (" + text[len("panic:"):].strip() + ")"
    text = "\n".join(text.splitlines()[:max_lines])
    return text if len(text) <= max_chars else text[:max_chars] + "..."

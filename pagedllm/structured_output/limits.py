"""Size and shape limits on grammars and schemas, checked in plain Python before any native
grammar code sees the input.

The grammar library recurses over rule chains and schema references in native code: a chain a
few thousand deep overflows its stack and kills the process. These checks walk the input
iteratively and refuse what is too large, too deep or too wide, each with an
``InvalidParamError`` naming the constraint's kind (the caller prefixes the request field).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from pagedllm.errors import InvalidParamError


class GrammarLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one structured-output constraint may be (the server's ``--max-grammar-*`` flags).

    Attributes:
        max_bytes: UTF-8 bytes of a schema (as compact JSON), regex, grammar or choice list.
        max_rules: rules (Lark/GBNF) or subschemas (JSON schema) in one constraint.
        max_depth: deepest chain of rules one rule reaches through others, of ``$ref``s, or of
            nested brackets / schema objects.
        max_alternatives: ``|`` alternatives in one rule, ``anyOf``/``oneOf``/``enum`` entries.
        max_choices: entries of a ``choice`` list.
        max_properties: properties of one object schema.
        compile_timeout_s: seconds the isolated compile check of one constraint may take.
    """

    max_bytes: int = 256 * 1024
    max_rules: int = 2000
    max_depth: int = 100
    max_alternatives: int = 1024
    max_choices: int = 4096
    max_properties: int = 256
    compile_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if not getattr(self, name) > 0:
                raise ValueError(f"grammar limit {name} must be positive, got {getattr(self, name)}")


def check_shape(kind: str, text: str, limits: GrammarLimits) -> None:
    """Refuse a constraint beyond ``limits``; ``kind`` and ``text`` are ``StructuredOutputsParams.key``.

    Linear in the size of ``text``; never recurses.

    Raises:
        InvalidParamError: ``param`` is ``kind``; the message names the limit and its value.
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise InvalidParamError(kind, f"the {_noun(kind)} is {size} bytes; the limit is {limits.max_bytes}")
    if kind == "choice":
        n = len(json.loads(text))
        if n > limits.max_choices:
            raise InvalidParamError(kind, f"choice has {n} entries; the limit is {limits.max_choices}")
    elif kind == "json":
        _check_schema(json.loads(text), limits)
    elif kind == "grammar":
        _check_grammar(text, limits)
    elif kind == "regex":
        depth = _bracket_depth(text)
        if depth > limits.max_depth:
            raise InvalidParamError(kind, f"the regex nests groups {depth} deep; the limit is {limits.max_depth}")


def _noun(kind: str) -> str:
    return {"json": "schema", "choice": "choice list"}.get(kind, kind)


def _too(kind: str, what: str, value: int, limit: int) -> InvalidParamError:
    return InvalidParamError(kind, f"the {_noun(kind)} is too complex: {what} is {value}; the limit is {limit}")


# -- JSON schemas --------------------------------------------------------------------------
_REF_PREFIXES = ("#/$defs/", "#/definitions/")
_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "enum", "prefixItems")


def _check_schema(schema: Any, limits: GrammarLimits) -> None:
    """Nesting depth, subschema count, properties per object, alternatives, and ``$ref`` chains."""
    refs: dict[str, set[str]] = {}  # definition name ("" for the root) -> definitions it refers to
    count = 0
    stack: list[tuple[Any, int, str]] = [(schema, 1, "")]
    while stack:
        node, depth, owner = stack.pop()
        if depth > limits.max_depth:
            raise _too("json", "the JSON nesting depth (every object and array, each keyword's included)", depth,
                       limits.max_depth)
        if isinstance(node, list):
            stack.extend((item, depth + 1, owner) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        count += 1
        if count > limits.max_rules:
            raise InvalidParamError("json", f"the schema is too complex: more than {limits.max_rules} subschemas")
        props = node.get("properties")
        if isinstance(props, dict) and len(props) > limits.max_properties:
            raise _too("json", "properties in one object", len(props), limits.max_properties)
        for key in _LIST_KEYWORDS:
            if isinstance(node.get(key), list) and len(node[key]) > limits.max_alternatives:
                raise _too("json", f"entries in one {key}", len(node[key]), limits.max_alternatives)
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = next((ref[len(p):] for p in _REF_PREFIXES if ref.startswith(p)), "" if ref == "#" else None)
            if target is not None:
                refs.setdefault(owner, set()).add(target)
        for key, value in node.items():
            if key in ("$defs", "definitions") and isinstance(value, dict) and depth == 1:
                stack.extend((sub, 2, name) for name, sub in value.items())
            elif key != "enum" and key != "const":
                stack.append((value, depth + 1, owner))
    chain = _longest_chain(refs, "")
    if chain > limits.max_depth:
        raise _too("json", "$ref chain length", chain, limits.max_depth)


# -- Lark and GBNF grammars ------------------------------------------------------------------
_LARK_RULE = re.compile(r"^[?!]?([A-Za-z_][\w]*)(?:\.-?\d+)?\s*:(?!:)")
_GBNF_RULE = re.compile(r"^([A-Za-z_][\w-]*)\s*::=")
_NAME = re.compile(r"[A-Za-z_][\w-]*")
_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|\'(?:[^\'\\\n]|\\.)*\'|/(?:[^/\\\n]|\\.)+/[imslux]*|\[(?:[^\]\\\n]|\\.)*\]')


def _check_grammar(text: str, limits: GrammarLimits) -> None:
    """Rule count, alternatives per rule, bracket depth, and the deepest chain of rule references."""
    bodies: dict[str, list[str]] = {}
    order: list[str] = []
    current: str | None = None
    for line in text.splitlines():
        stripped = line.split("//", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not stripped or stripped.startswith("%"):
            continue
        match = _LARK_RULE.match(stripped) or _GBNF_RULE.match(stripped)
        if match and (current is None or not line[:1].isspace()):
            current = match.group(1)
            if current not in bodies:
                order.append(current)
                if len(order) > limits.max_rules:
                    raise InvalidParamError("grammar", f"the grammar is too complex: more than {limits.max_rules} rules")
            bodies.setdefault(current, []).append(stripped[match.end():])
        elif current is not None:  # a continuation line ("| ...")
            bodies[current].append(stripped)
    graph: dict[str, set[str]] = {}
    for name, parts in bodies.items():
        body = _LITERALS.sub(" ", " ".join(parts))
        alternatives = body.count("|") + 1
        if alternatives > limits.max_alternatives:
            raise _too("grammar", f"alternatives in rule {name!r}", alternatives, limits.max_alternatives)
        depth = _bracket_depth(body)
        if depth > limits.max_depth:
            raise _too("grammar", f"bracket depth in rule {name!r}", depth, limits.max_depth)
        graph[name] = {ref for ref in _NAME.findall(body) if ref in bodies and ref != name}
    start = next((s for s in ("start", "root") if s in bodies), order[0] if order else None)
    if start is not None:
        chain = _longest_chain(graph, start)
        if chain > limits.max_depth:
            raise _too("grammar", "rule chain depth", chain, limits.max_depth)


# -- shared walks ----------------------------------------------------------------------------
def _bracket_depth(text: str) -> int:
    depth = deepest = 0
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}" and depth:
            depth -= 1
    return deepest


def _longest_chain(graph: dict[str, set[str]], start: str) -> int:
    """Edges on the longest reference path from ``start`` that repeats no node, iteratively;
    a reference back into the current path (recursion) ends the path there."""
    longest: dict[str, int] = {}
    on_path: set[str] = {start}
    stack: list[tuple[str, list[str]]] = [(start, sorted(graph.get(start, ())))]
    while stack:
        node, todo = stack[-1]
        if todo:
            child = todo.pop()
            if child not in longest and child not in on_path:
                on_path.add(child)
                stack.append((child, sorted(graph.get(child, ()))))
            continue
        stack.pop()
        on_path.discard(node)
        longest[node] = max((longest.get(c, 0) + 1 for c in graph.get(node, ()) if c in longest), default=0)
    return longest.get(start, 0)

"""The kernels' C interface, read from its one declaration, ``csrc/pagedllm_abi.h``.

The header is parsed once at import into ``CONSTANTS`` (its ``#define``s), ``STRUCTS``
(ctypes.Structure classes, fields in declaration order) and ``FUNCTIONS`` (each exported
function's ctypes restype and argtypes); ``bind`` gives a loaded library those signatures.
Nothing here repeats a signature, a struct or a limit: change the header and this follows.

The parser is strict and reads only the C subset the header is written in; anything else
raises ``HeaderError`` naming the construct:
  * ``/* */`` and ``//`` comments;
  * preprocessor lines ``#pragma once``, ``#include <...>``, ``#define NAME <integer>``,
    ``#define NAME {<integer>, ...}``, and an ``#ifdef __cplusplus`` ... ``#endif`` block,
    skipped whole (the ``extern "C"`` braces live there);
  * ``typedef struct Name { <type> <name>; ... } Name;`` with one field per declaration, a
    field being a type from the table below, a pointer, an earlier struct, or a fixed array
    ``<type> <name>[<integer or #define>]``;
  * prototypes ``<type> <name>(<type> <name>, ...);`` or ``<type> <name>(void);``.
Types: ``void``, ``char``, ``int``, ``float``, ``double``, ``[u]int{8,16,32,64}_t``, each with
``const`` anywhere. Pointers map to ``c_void_p`` (callers pass addresses as ints), except a
single pointer to a declared struct (``POINTER(struct)``) and ``const char*`` (``c_char_p``).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "pagedllm_abi.h"

_SCALARS: dict[str, type | None] = {
    "void": None, "char": ctypes.c_char, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double,
    "int8_t": ctypes.c_int8, "uint8_t": ctypes.c_uint8, "int16_t": ctypes.c_int16, "uint16_t": ctypes.c_uint16,
    "int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
}
_IDENT = r"[A-Za-z_]\w*"
_DEFINE = re.compile(rf"#define\s+({_IDENT})\s+(.+)")
_STRUCT = re.compile(rf"typedef\s+struct\s+({_IDENT})\s*\{{(.*)\}}\s*({_IDENT})", re.S)
_FUNCTION = re.compile(rf"(.+?)\b({_IDENT})\s*\((.*)\)", re.S)
_DECLARATOR = re.compile(rf"(.*?)\b({_IDENT})\s*(?:\[\s*(\w+)\s*\])?")


class HeaderError(ValueError):
    """The header uses C this parser does not read (the message names it)."""


class ABIMismatch(Exception):
    """A library that does not match the header: a missing export or other limits."""


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))


def _integer(text: str, constants: dict[str, int | tuple[int, ...]]) -> int:
    text = text.strip()
    value = constants.get(text, text)
    if isinstance(value, int):
        return value
    if re.fullmatch(r"-?\d+", str(value)):
        return int(value)
    raise HeaderError(f"not an integer or an integer #define: {text!r}")


def _ctype(declared: str, structs: dict[str, type], returned: bool = False) -> type | None:
    """The ctypes type of a C type spelled like ``const float*`` (no name); None for a
    returned ``void``."""
    stars = declared.count("*")
    words = [w for w in declared.replace("*", " ").split() if w != "const"]
    if len(words) != 1:
        raise HeaderError(f"unsupported type {declared.strip()!r}")
    base = words[0]
    if base in structs:
        target: type | None = structs[base]
    elif base in _SCALARS:
        target = _SCALARS[base]
    else:
        raise HeaderError(f"unknown type {base!r} in {declared.strip()!r}")
    if stars == 0:
        if target is None and not returned:
            raise HeaderError("void is only a return type")
        return target
    if stars == 1 and base in structs:
        return ctypes.POINTER(target)
    if stars == 1 and base == "char":
        return ctypes.c_char_p
    return ctypes.c_void_p


def _declaration(text: str, structs: dict[str, type], constants: dict) -> tuple[str, type | None]:
    """(name, ctypes type) of ``<type> <name>`` or ``<type> <name>[N]``."""
    match = _DECLARATOR.fullmatch(text.strip())
    if not match or not match.group(1).strip():
        raise HeaderError(f"expected '<type> <name>', got {text.strip()!r}")
    ctype = _ctype(match.group(1), structs)
    if match.group(3) is not None:
        ctype = ctype * _integer(match.group(3), constants)
    return match.group(2), ctype


def parse(text: str) -> tuple[dict[str, int | tuple[int, ...]], dict[str, type], dict[str, tuple]]:
    """(constants, structs, functions) declared by a header in the subset above; functions
    map each name to ``(restype, [argtypes])``.

    Raises:
        HeaderError: a construct outside the subset.
    """
    constants: dict[str, int | tuple[int, ...]] = {}
    structs: dict[str, type] = {}
    functions: dict[str, tuple] = {}
    body, skipping = [], False
    for line in _strip_comments(text).splitlines():
        stripped = line.strip()
        if skipping:
            skipping = stripped != "#endif"
            continue
        if not stripped.startswith("#"):
            body.append(line)
        elif stripped == "#ifdef __cplusplus":
            skipping = True
        elif define := _DEFINE.fullmatch(stripped):
            name, value = define.groups()
            if value.startswith("{") and value.endswith("}"):
                constants[name] = tuple(_integer(v, constants) for v in value[1:-1].split(","))
            else:
                constants[name] = _integer(value, constants)
        elif stripped != "#pragma once" and not re.fullmatch(r"#include\s*<[\w./]+>", stripped):
            raise HeaderError(f"unsupported preprocessor line {stripped!r}")
    for statement in _split_top_level(" ".join(body)):
        if struct := _STRUCT.fullmatch(statement):
            tag, fields_text, name = struct.groups()
            if tag != name:
                raise HeaderError(f"typedef struct {tag} {{...}} {name}: the two names must be equal")
            fields = [_declaration(f, structs, constants) for f in fields_text.split(";") if f.strip()]
            structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
        elif function := _FUNCTION.fullmatch(statement):
            returns, name, params = function.groups()
            argtypes = [] if params.strip() == "void" else [
                _declaration(p, structs, constants)[1] for p in params.split(",")
            ]
            functions[name] = (_ctype(returns, structs, returned=True), argtypes)
        else:
            raise HeaderError(f"not a struct typedef or a prototype: {statement[:80]!r}")
    return constants, structs, functions


def _split_top_level(text: str) -> list[str]:
    """Statements ended by ';' outside braces."""
    statements, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == ";" and depth == 0:
            statements.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        raise HeaderError(f"unterminated declaration {text[start:].strip()[:80]!r}")
    return [s for s in statements if s]


CONSTANTS, STRUCTS, FUNCTIONS = parse(HEADER.read_text())


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give each of the library's exports its declared signature and check that it was
    compiled with the header's limits.

    Raises:
        ABIMismatch: an export is missing, or ``pagedllm_limits()`` differs from the header.
    """
    missing = [name for name in FUNCTIONS if not hasattr(lib, name)]
    if missing:
        raise ABIMismatch(f"the library lacks {', '.join(missing)} (built from another pagedllm_abi.h)")
    for name, (restype, argtypes) in FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    limits = lib.pagedllm_limits().contents
    expected = {
        "max_group": CONSTANTS["PAGEDLLM_MAX_GROUP"], "head_dims": CONSTANTS["PAGEDLLM_HEAD_DIMS"],
        "max_prefill_block": CONSTANTS["PAGEDLLM_MAX_PREFILL_BLOCK"], "panel": CONSTANTS["PAGEDLLM_PANEL"],
        "quant_group": CONSTANTS["PAGEDLLM_QUANT_GROUP"], "q4a8_group_bytes": CONSTANTS["PAGEDLLM_Q4A8_GROUP_BYTES"],
    }
    found = {name: getattr(limits, name) for name in expected if name != "head_dims"}
    found["head_dims"] = tuple(limits.head_dims[: limits.num_head_dims])
    if found != expected:
        raise ABIMismatch(f"the library's limits {found} differ from pagedllm_abi.h's {expected}")
    return lib

"""Hostile grammars and schemas never reach native code unchecked: plain-Python limits first,
then a compile in a grammar worker process whose crash, hang or SIGKILL fails that one check
with an ``InvalidParamError`` naming the field, never the caller."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.errors import InvalidParamError
from pagedllm.structured_output import StructuredOutputsParams
from pagedllm.structured_output.checker import CACHE_BYTES, GrammarChecker
from pagedllm.structured_output.limits import GrammarLimits, check_shape
from tests.utils import lark_chain, many_properties, nested_arrays, ref_chain


LIMITS = GrammarLimits()
# Limits far above the defaults, so that what the defaults refuse in Python reaches the worker.
LOOSE = GrammarLimits(max_bytes=10**8, max_rules=10**7, max_depth=10**7, max_alternatives=10**7,
                      max_choices=10**7, max_properties=10**7, compile_timeout_s=120)


@pytest.fixture(scope="module")
def checker():
    c = GrammarChecker(LIMITS)
    yield c
    c.close()


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"grammar": lark_chain(3000)}, "more than 2000 rules"),
        ({"grammar": lark_chain(1500)}, "rule chain depth is 1501"),
        ({"grammar": "start: a\na: " + " | ".join(f'"{i}"' for i in range(2000))}, "alternatives"),
        ({"grammar": "start: " + "(" * 200 + '"x"' + ")" * 200}, "bracket depth"),
        ({"json": ref_chain(1500)}, "$ref chain length is 1501"),
        ({"json": ref_chain(3000)}, "more than 2000 subschemas"),
        ({"json": nested_arrays(500)}, "nesting depth"),
        ({"json": many_properties(10_000)}, "properties in one object is 10000"),
        ({"json": {"anyOf": [{"const": i} for i in range(5000)]}}, "entries in one anyOf"),
        ({"choice": [f"c{i}" for i in range(100_000)]}, "bytes"),
        ({"choice": [str(i) for i in range(5000)]}, "choice has 5000 entries"),
        ({"regex": "(" * 300 + "a" + ")" * 300}, "nests groups 300 deep"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else v[:20],
)
def test_limits_refuse_before_native_code(fields: dict, words: str) -> None:
    params = StructuredOutputsParams(**fields)
    with pytest.raises(InvalidParamError) as info:
        check_shape(*params.key, LIMITS)
    assert info.value.param == params.kind
    assert words in str(info.value) and len(str(info.value)) < 300


@pytest.mark.parametrize(
    "fields",
    [
        {"grammar": 'start: node\nnode: "(" node* ")" | "x"'},  # recursion with a way out
        {"grammar": 'root ::= "yes" | "no"'},
        {"json": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}},
        {"json": ref_chain(50)},
        {"json": many_properties(256)},
        {"choice": [f"c{i}" for i in range(4096)]},
        {"regex": r"[a-z]+@[a-z]+\.(com|org)"},
    ],
    ids=["tree", "gbnf", "recursive-schema", "refs-50", "props-256", "choice-4096", "regex"],
)
def test_reasonable_constraints_pass(checker: GrammarChecker, fields: dict) -> None:
    assert checker.check(*StructuredOutputsParams(**fields).key)


@pytest.mark.parametrize(
    "fields",
    [
        {"json": {"$ref": "#"}},
        {"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}},
        {"json": {"allOf": [{"$ref": "#"}]}},
        {"grammar": 'start: a\na: a "x"'},
        {"grammar": "root ::= root"},
    ],
    ids=["self-ref", "ref-cycle", "allOf-self", "left-recursive", "gbnf-self"],
)
def test_grammars_that_cannot_finish_are_refused(checker: GrammarChecker, fields: dict) -> None:
    params = StructuredOutputsParams(**fields)
    with pytest.raises(InvalidParamError, match="no output can complete it") as info:
        checker.check(*params.key)
    assert info.value.param == params.kind


@pytest.mark.parametrize("regex", ["a{1000000}", "(ab){500000}"])
def test_a_limit_hit_once_output_starts_is_refused_up_front(checker: GrammarChecker, regex: str) -> None:
    """Its first mask computes; at its second byte the lexer builds too many expressions, which
    would fail the request while it generates, after a stream's 200 (shared/cases' kind)."""
    with pytest.raises(InvalidParamError, match="too many expressions") as info:
        checker.check("regex", regex)
    assert info.value.param == "regex"
    assert checker.check("regex", "a{1000}")  # a long repetition that stays within the limits


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"json": {"type": "string", "pattern": "(("}},
      "the schema cannot be compiled: regex parse error: unclosed group"),
     ({"regex": "[a-"}, "regex parse error: unclosed character class"),
     ({"grammar": "start: /((/"}, "(in regex): regex parse error: unclosed group")],
    ids=["schema-pattern", "regex", "lark-regex"],
)
def test_a_bad_regex_is_refused_with_its_reason(checker: GrammarChecker, fields: dict, message: str) -> None:
    """The reason follows the heading (the message stopped at "regex parse error:")."""
    params = StructuredOutputsParams(**fields)
    with pytest.raises(InvalidParamError, match=re.escape(message)) as info:
        checker.check(*params.key)
    assert info.value.param == params.kind


def test_a_crashing_compile_costs_only_its_worker() -> None:
    """The 3,000-rule chain segfaults llguidance: in a worker, that is one refused grammar."""
    c = GrammarChecker(LOOSE, workers=1)
    try:
        with pytest.raises(InvalidParamError, match="too complex") as info:
            c.check("grammar", lark_chain(3000))
        assert info.value.param == "grammar"
        assert c.check("choice", json.dumps(["yes", "no"]))  # a new worker serves the next check
    finally:
        c.close()


def _busy_worker(c: GrammarChecker) -> int:
    """The pid of a worker that has spent CPU time on its job (it is compiling)."""
    for _ in range(600):
        for pid in c.worker_pids():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[11]) > 10:  # utime, clock ticks
                        return pid
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError("no worker got busy")


def test_sigkill_mid_compile_fails_only_that_check() -> None:
    c = GrammarChecker(LOOSE, workers=2)
    slow = json.dumps(many_properties(10_000))  # seconds of compiling in the worker
    outcome: list[BaseException | str] = []

    def run_slow() -> None:
        try:
            outcome.append(c.check("json", slow))
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            outcome.append(e)

    try:
        thread = threading.Thread(target=run_slow)
        thread.start()
        pid = _busy_worker(c)
        assert c.check("regex", "[0-9]+")  # the other worker answers meanwhile
        os.kill(pid, signal.SIGKILL)
        thread.join(60)
        assert isinstance(outcome[0], InvalidParamError) and outcome[0].param == "json", outcome
        assert "too complex" in str(outcome[0])
        assert c.check("choice", json.dumps(["a", "b"]))
    finally:
        c.close()


def test_a_compile_past_its_budget_is_abandoned() -> None:
    c = GrammarChecker(GrammarLimits(max_bytes=10**7, max_rules=10**6, max_properties=10**6, compile_timeout_s=0.5),
                       workers=1)
    try:
        with pytest.raises(InvalidParamError, match="did not compile within 0.5 s"):
            c.check("json", json.dumps(many_properties(10_000)))
        assert c.check("regex", "[a-z]")
    finally:
        c.close()


def test_the_result_cache_is_bounded_by_bytes(checker: GrammarChecker) -> None:
    schema = many_properties(200)
    for i in range(60):
        checker.check("json", json.dumps(schema | {"description": f"{i}" + "x" * 100_000}))
    assert checker._cache.num_bytes <= CACHE_BYTES


def test_a_cached_refusal_holds_no_traceback(checker: GrammarChecker) -> None:
    """A refusal's traceback holds its frames (the parsed schema, the caller's request), which
    the cache's size does not count: the cache keeps an error that was never raised."""
    text = json.dumps(many_properties(LIMITS.max_properties + 1) | {"description": "cached refusal"})
    for _ in range(2):  # a miss, then a hit
        with pytest.raises(InvalidParamError, match="properties in one object") as info:
            checker.check("json", text)
        cached = checker._cache.get(("json", text))
        assert isinstance(cached, InvalidParamError) and cached is not info.value
        assert cached.__traceback__ is None and cached.param == "json" and str(cached) == str(info.value)


# -- property tests: whatever the shape, an answer and never a crash ----------------------------
def _chain_grammar(depth: int, width: int) -> str:
    rules = [f'r{i}: r{i + 1} "{i}" | ' + " | ".join(f'"w{j}"' for j in range(width)) for i in range(depth)]
    return "start: r0\n" + "\n".join(rules) + f'\nr{depth}: "end"'


def _deep_schema(depth: int, width: int, kind: str) -> dict:
    node: dict = {"type": "integer"}
    for i in range(depth):
        if kind == "object":
            node = {"type": "object", "properties": {f"k{j}": node if j == 0 else {"type": "string"} for j in range(width)}}
        elif kind == "anyOf":
            node = {"anyOf": [node] + [{"const": j} for j in range(width)]}
        else:
            node = {"type": "array", "items": node}
    return node


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    depth=st.integers(0, 4000),
    width=st.integers(1, 3000),
    shape=st.sampled_from(["grammar", "object", "anyOf", "array"]),
)
def test_deep_and_wide_inputs_get_an_answer(checker: GrammarChecker, depth: int, width: int, shape: str) -> None:
    if shape == "grammar":
        fields = {"grammar": _chain_grammar(depth, min(width, 3000 // max(depth, 1) + 1))}
    else:
        fields = {"json": _deep_schema(min(depth, 400), min(width, 3000 // max(depth, 1) + 1), shape)}
    try:
        assert checker.check(*StructuredOutputsParams(**fields).key)
    except InvalidParamError as e:
        assert e.param in ("grammar", "json") and len(str(e)) < 400


def test_bounded_cache_evicts_least_recently_used_by_count_and_bytes() -> None:
    from pagedllm.structured_output.cache import BoundedCache

    cache: BoundedCache[str, int] = BoundedCache(max_entries=3, max_bytes=10)
    for key in "abc":
        cache.put(key, ord(key), 2)
    assert cache.get("a") == ord("a")  # now the most recent: "b" is the oldest
    cache.put("d", 0, 2)
    assert cache.get("b") is None and len(cache) == 3 and cache.num_bytes == 6
    cache.put("e", 0, 9)  # over the bytes: every older entry goes, the newest stays
    assert len(cache) == 1 and cache.num_bytes == 9 and cache.get("e") == 0
    cache.put("e", 1, 4)  # a replaced entry's bytes are given back
    assert cache.num_bytes == 4 and cache.get("e") == 1

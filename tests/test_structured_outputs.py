"""Structured outputs in the engine (offline ``LLM``, float32, default model): outputs valid under
every scheduling feature, greedy outputs unchanged by them, unconstrained neighbours untouched,
and bad constraints refused before anything is queued."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.errors import InvalidParamError
from tests.utils import pool_is_whole

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CHAT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
PLAIN = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,"]


def json_params(**kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON), **({"max_tokens": 60} | kwargs))


def regex_params(**kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(regex=DATE), **({"max_tokens": 12} | kwargs))


def assert_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=1024)
    yield engine
    assert pool_is_whole(engine)


@pytest.fixture(scope="module")
def greedy(llm) -> dict[str, str]:
    """Greedy constrained outputs with no feature in play (one request at a time)."""
    return {
        "json": llm.generate(CHAT, json_params(temperature=0), use_tqdm=False)[0].outputs[0].text,
        "regex": llm.generate("Today's date is", regex_params(temperature=0), use_tqdm=False)[0].outputs[0].text,
    }


def test_json_regex_choice_grammar(llm, greedy):
    assert_person(greedy["json"])
    assert re.fullmatch(DATE, greedy["regex"])
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    gbnf = 'root ::= "The answer is " ("red" | "blue") "."'
    grammar = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(grammar=gbnf))
    lark = SamplingParams(temperature=0, max_tokens=16,
                          structured_outputs=StructuredOutputsParams(grammar='start: "x=" /[0-9]{2}/ ";"'))
    outs = llm.generate(["Is water wet?", "What color is the sky?", "Set x:"], [choice, grammar, lark], use_tqdm=False)
    assert outs[0].outputs[0].text in ("yes", "no") and outs[0].outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"The answer is (red|blue)\.", outs[1].outputs[0].text)
    assert re.fullmatch(r"x=[0-9]{2};", outs[2].outputs[0].text)


def test_choices_beyond_the_parsers_row_limit(llm):
    """3000 choices (within --max-grammar-choices, 4096; llguidance's parser holds 2000 items in
    a row): every sample is one of them."""
    choices = [f"option {i}" for i in range(3000)]
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    out = llm.generate("Pick an option:", params, use_tqdm=False)[0]
    assert [c.finish_reason for c in out.outputs] == ["stop"] * 3
    assert all(c.text in choices for c in out.outputs), [c.text for c in out.outputs]


def test_a_grammar_past_a_lexer_limit_fails_its_request_alone(llm):
    """A regex that compiles but outgrows llguidance's lexer at its 10th token (after 9 digits:
    past the bytes the compile check walks): finish_reason "error" naming ``structured_outputs``
    (the request's own fault), the first time (its token fails) and again (its cached matcher's
    mask fails); its neighbour is served."""
    bad = SamplingParams(temperature=0, max_tokens=16,
                         structured_outputs=StructuredOutputsParams(regex="[0-9]{9}(a{997}){1000}"))
    for _ in range(2):
        failed, fine = llm.generate(["Say aaaa", "Today's date is"], [bad, regex_params(temperature=0)], use_tqdm=False)
        assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].error_param == "structured_outputs"
        assert "the grammar failed while generating: lexer error" in failed.outputs[0].error
        assert re.fullmatch(DATE, fine.outputs[0].text)
    assert not llm.engine.core.has_unfinished_requests() and pool_is_whole(llm)


def test_min_tokens_beyond_a_complete_grammar_fails_its_request_alone(llm, greedy):
    """A grammar complete after fewer than ``min_tokens`` tokens leaves only EOS, which
    ``min_tokens`` masks: the request fails naming ``structured_outputs`` (it used to stop with
    ``min_tokens`` ignored); where the grammar's end is not sooner, ``min_tokens`` changes nothing;
    with ``ignore_eos`` (no EOS mask) the complete grammar stops the request."""
    dates = len(llm.generate("Today's date is", regex_params(temperature=0), use_tqdm=False)[0].outputs[0].token_ids)
    for min_tokens, ignore_eos in ((dates + 1, False), (dates, False), (dates + 1, True)):
        params = regex_params(temperature=0, min_tokens=min_tokens, ignore_eos=ignore_eos)
        short, fine = llm.generate(["Today's date is", "Today's date is"], [params, regex_params(temperature=0)],
                                   use_tqdm=False)
        assert fine.outputs[0].text == greedy["regex"]
        if min_tokens > dates and not ignore_eos:
            assert short.outputs[0].finish_reason == "error" and short.outputs[0].error_param == "structured_outputs"
            assert "no token can be sampled" in short.outputs[0].error
        else:
            assert (short.outputs[0].finish_reason, short.outputs[0].text) == ("stop", greedy["regex"])
    assert not llm.engine.core.has_unfinished_requests() and pool_is_whole(llm)


def test_stop_string_cuts_a_constrained_output(llm, greedy):
    out = llm.generate(CHAT, json_params(temperature=0, stop=[","]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == ","
    assert out.text == greedy["json"].split(",")[0]


def test_json_object_and_cut_output_is_length(llm):
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json_object=True))
    out = llm.generate(CHAT, params, use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    cut = llm.generate(CHAT, json_params(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5


def test_unconstrained_neighbours_unchanged(llm):
    plain = SamplingParams(temperature=0, max_tokens=16)
    alone = [o.outputs[0].token_ids for o in llm.generate(PLAIN, plain, use_tqdm=False)]
    mixed = llm.generate(
        [CHAT, PLAIN[0], "Today's date is", PLAIN[1], CHAT, PLAIN[2]],
        [json_params(temperature=0), plain, regex_params(temperature=0), plain, json_params(temperature=1, seed=3), plain],
        use_tqdm=False,
    )
    assert [mixed[i].outputs[0].token_ids for i in (1, 3, 5)] == alone
    assert_person(mixed[0].outputs[0].text)
    assert mixed[4].outputs[0].finish_reason == "length" or assert_person(mixed[4].outputs[0].text) is None
    assert re.fullmatch(DATE, mixed[2].outputs[0].text)


def test_sampled_n3_outputs_valid(llm):
    outs = llm.generate([CHAT, "Today's date is"],
                        [json_params(temperature=1.0, n=3, seed=7), regex_params(temperature=1.0, n=3)], use_tqdm=False)
    for c in outs[0].outputs:
        assert c.finish_reason == "length" or assert_person(c.text) is None
    assert len(outs[1].outputs) == 3 and all(re.fullmatch(DATE, c.text) for c in outs[1].outputs)


@pytest.mark.parametrize(
    "features",
    [
        {"max_num_batched_tokens": 8},  # chunked prefill
        {"num_gpu_blocks_override": 12, "block_size": 8, "enable_prefix_caching": False},  # preemption
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}},
        # The model drafting for itself: drafts with probabilities, cut to the grammar's prefix.
        {"speculative_config": {"method": "draft_model", "model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 3}},
    ],
    ids=["chunked-prefill", "preemption", "ngram-spec", "draft-model-spec"],
)
def test_features_keep_outputs_valid_and_greedy_unchanged(greedy, features):
    engine = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, **features)
    prompts = [CHAT, "Today's date is"] * 3
    params = [json_params(temperature=0), regex_params(temperature=0)] * 3
    outs = engine.generate(prompts, params, use_tqdm=False)
    for i in range(0, 6, 2):
        assert outs[i].outputs[0].text == greedy["json"]
        assert outs[i + 1].outputs[0].text == greedy["regex"]
    sampled = engine.generate([CHAT] * 3, json_params(temperature=1.0, seed=11), use_tqdm=False)
    for o in sampled:
        assert o.outputs[0].finish_reason == "length" or assert_person(o.outputs[0].text) is None
    if "num_gpu_blocks_override" in features:
        assert engine.engine.core.scheduler.num_preemptions > 0
    if "speculative_config" in features:
        assert engine.engine.core.scheduler.spec_stats.num_drafts > 0
    assert pool_is_whole(engine)


def test_compile_cache_and_prefix_caching(llm):
    core = llm.engine.core
    prompt = "<|im_start|>system\nYou answer with one JSON object describing a person, nothing else.<|im_end|>\n" + CHAT
    first = llm.generate(prompt, json_params(temperature=0), use_tqdm=False)[0]
    compiled = dict(core.structured._cache.items())
    second = llm.generate(prompt, json_params(temperature=0), use_tqdm=False)[0]
    assert dict(core.structured._cache.items()) == compiled  # the same schema: compiled once, reused
    assert second.num_cached_tokens >= 16  # a prefix-cache hit leaves the grammar state right
    assert second.outputs[0].text == first.outputs[0].text
    assert_person(second.outputs[0].text)


@pytest.mark.parametrize(
    ("constraint", "param"),
    [
        ({"json": {"type": "strin"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "a(b"}, "structured_outputs.regex"),
        ({"grammar": "start: nowhere"}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
        ({}, "structured_outputs"),
        ({"regex": "a", "choice": ["b"]}, "structured_outputs.choice"),
    ],
)
def test_bad_constraints_are_refused_before_queueing(llm, constraint, param):
    with pytest.raises(InvalidParamError) as e:
        llm.generate(["Hi", "Hello"], [SamplingParams(), SamplingParams(structured_outputs=_unchecked(**constraint))],
                     use_tqdm=False)
    assert e.value.param == param
    assert not llm.engine.core.has_unfinished_requests()


def _unchecked(**fields) -> StructuredOutputsParams:
    """Params built without the constructor's check, as a mutated struct would reach ``generate``."""
    params = StructuredOutputsParams(regex="x")
    params.regex = None
    for name, value in fields.items():
        setattr(params, name, value)
    return params


def test_background_masks_and_their_application(llm):
    """Masks filled in the background match those filled in place, for any subset and order of
    the grammars, and applying them bans exactly the tokens whose bit is clear."""
    import torch

    from pagedllm.structured_output.bitmask import PendingMasks, apply_bitmask, fill_bitmask

    manager = llm.engine.core.structured
    states = [manager.request_state(json_params().structured_outputs) for _ in range(2)]
    states.append(manager.request_state(regex_params().structured_outputs))
    for s in states:
        s.compiled.result()
        assert s.is_ready
    states[1].accept(states[1].matcher.compute_ff_tokens()[0])  # '{': a state of its own
    vocab = llm.engine.core.model_config.vocab_size
    pending = PendingMasks(states, vocab)
    subset = [states[2], states[0]]
    assert torch.equal(pending.masks(subset), fill_bitmask(subset, vocab))
    assert torch.equal(pending.masks(states), fill_bitmask(states, vocab))

    bitmask = pending.masks(subset)
    logits = torch.randn(4, vocab)
    expected = logits.clone()
    for mask_row, row in zip(bitmask, [3, 1]):
        bits = (mask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        expected[row, bits.flatten()[:vocab] == 0] = -torch.inf
    apply_bitmask(logits, bitmask, [3, 1])
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[[0, 2]]).all()


def test_draft_masks_with_a_forbidden_last_draft(llm):
    """Draft rows: the mask after each allowed draft; a forbidden last draft (a draft model's
    sampled one, kept for the verifier to reject) is not consumed, the row after it repeats its
    mask, and the matcher is left as it was."""
    import torch

    from pagedllm.structured_output.bitmask import fill_bitmask

    state = llm.engine.core.structured.request_state(StructuredOutputsParams(choice=["yes", "yesno"]))
    state.compiled.result()
    assert state.is_ready
    tokenizer = llm.get_tokenizer()
    yes, z = tokenizer.encode("yes", add_special_tokens=False)[0], tokenizer.convert_tokens_to_ids("z")
    assert state.num_valid([yes, z]) == 1
    vocab = llm.engine.core.model_config.vocab_size
    start, after_yes = fill_bitmask([state], vocab, [[yes]])
    masks = fill_bitmask([state], vocab, [[yes, z]])
    assert torch.equal(masks, torch.stack([start, after_yes, after_yes]))
    assert not state.matcher.is_error() and torch.equal(fill_bitmask([state], vocab), start.unsqueeze(0))


def test_a_schema_with_integers_past_64_bits_reaches_the_engine_core() -> None:
    """msgpack, which carries a request to the engine core process, holds no integer past 64
    bits; a schema holding one (``default``, ``const``, ``enum``, bounds) travels as its JSON
    text (a server answered such a schema with a 500, "OverflowError"). NaN in a schema given
    as a dict is refused by name."""
    import msgspec

    big = {"type": "integer", "default": 10**20, "enum": [10**20, -(2**70)], "minimum": -(2**70)}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=big))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert json.loads(back.structured_outputs.json) == big
    assert back.structured_outputs.key == params.structured_outputs.key
    with pytest.raises(InvalidParamError, match="NaN or Infinity") as e:
        StructuredOutputsParams(json={"type": "number", "maximum": float("nan")})
    assert e.value.param == "json"

"""Input validation shared by every entry point: SamplingParams' ranges and types, text that is
not Unicode scalar values, and ``LLM.generate`` refusing a whole batch before queueing any of it."""

from __future__ import annotations

import math
import threading

import pytest

from pagedllm import LLM
from pagedllm.errors import InvalidParamError
from pagedllm.sampling_params import MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams, check_text

FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
INT_FIELDS = ["n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"]
BOOL_FIELDS = ["include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize",
               "spaces_between_special_tokens"]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 10**400, "1", None, True])
def test_float_fields_must_be_finite_numbers(field: str, value: object) -> None:
    with pytest.raises(InvalidParamError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and field in str(e.value)


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 1.5, "2", True])
def test_int_fields_must_be_64_bit_integers(field: str, value: object) -> None:
    with pytest.raises(InvalidParamError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


@pytest.mark.parametrize("field", BOOL_FIELDS)
@pytest.mark.parametrize("value", ["no", 0, 1, None, 1.0])
def test_bool_fields_must_be_booleans(field: str, value: object) -> None:
    """A truthy "no" must not turn a flag on, nor None reach the engine core's decoder."""
    with pytest.raises(InvalidParamError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and field in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 2.0001}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"n": MAX_N + 1}, "n"),  # each sample is a request made up front: 2**62 never returned
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ["ok", "a\ud800"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        # Keys that int() reads but that are no token id as JSON writes one; a token named twice.
        ({"logit_bias": {"5_0": 1.0}}, "logit_bias"),
        ({"logit_bias": {" 5 ": 1.0}}, "logit_bias"),
        ({"logit_bias": {"+5": 1.0}}, "logit_bias"),
        ({"logit_bias": {"05": 1.0}}, "logit_bias"),
        ({"logit_bias": {"\u0665": 1.0}}, "logit_bias"),  # ARABIC-INDIC DIGIT FIVE
        ({"logit_bias": {"5": 1.0, 5: -1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -3]}, "allowed_token_ids"),
        ({"bad_words": ["\udfff"]}, "bad_words"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words_token_ids": 5}, "bad_words_token_ids"),  # was a TypeError naming no field
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"stop": "x", "detokenize": False}, "stop"),  # was a bare ValueError from the detokenizer
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_out_of_range(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_documented_bounds_are_accepted() -> None:
    p = SamplingParams(n=MAX_N, temperature=2, top_k=-1, min_p=1, presence_penalty=-2, repetition_penalty=3.0,
                       seed=2**63 - 1, logit_bias={"3": -100, 4: 100}, allowed_token_ids=[0],
                       stop=[f"{i:0{MAX_STOP_STRING_CHARS}}" for i in range(MAX_STOP_STRINGS)])
    assert p.temperature == 2.0 and isinstance(p.temperature, float) and p.top_k == 0
    assert p.logit_bias == {3: -100.0, 4: 100.0}


def test_check_text() -> None:
    assert check_text("naïve 🙂", "prompt") == "naïve 🙂"
    with pytest.raises(InvalidParamError, match="U\\+D800 at index 2"):
        check_text("ab\ud800cd", "prompt")


# -- LLM: a bad request anywhere in a batch refuses the batch --------------------------------------
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=256)


def _mutated(**fields: object) -> SamplingParams:
    """A struct with ``fields`` set after construction, past its checks."""
    params = SamplingParams()
    for name, value in fields.items():
        setattr(params, name, value)
    return params


def _idle(llm: LLM) -> bool:
    return not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompts", "params", "param"),
    [
        (["Hello", "ab\ud800cd", "Bye"], None, "prompt"),
        (["Hello", [1, 10**9], "Bye"], None, "prompt"),
        (["Hello", [1, True], "Bye"], None, "prompt"),
        (["Hello", None, "Bye"], None, "prompt"),
        (["Hello", "Hi", "Bye"], [SamplingParams(), _mutated(max_tokens=0), SamplingParams()], "max_tokens"),
        (["Hello", "Hi", "Bye"], [SamplingParams(), SamplingParams(logit_bias={10**6: 1}), SamplingParams()],
         "logit_bias"),
        (["Hello", "Hi", "Bye"], [SamplingParams(), SamplingParams(allowed_token_ids=[10**6]), SamplingParams()],
         "allowed_token_ids"),
        (["Hello", "Hi", "Bye"], [SamplingParams(), "greedy", SamplingParams()], "sampling_params"),
        # refused only when the detokenizer was made, after "Hello" was queued: the next generate ran it
        (["Hello", "Hi"], [SamplingParams(), _mutated(detokenize=False, stop=["x"])], "stop"),
    ],
)
def test_generate_refuses_the_whole_batch(llm: LLM, prompts: list, params: list | None, param: str) -> None:
    with pytest.raises(ValueError) as e:
        llm.generate(prompts, params, use_tqdm=False)
    assert getattr(e.value, "param", None) == param
    assert _idle(llm)


def test_generate_rechecks_a_mutated_params_struct(llm: LLM) -> None:
    bad = SamplingParams()
    bad.temperature = math.nan  # a struct is mutable: construction-time checks are not enough
    with pytest.raises(InvalidParamError) as e:
        llm.generate(["Hello", "Hi"], [SamplingParams(), bad], use_tqdm=False)
    assert e.value.param == "temperature" and _idle(llm)


def test_a_mutated_params_struct_is_normalized_as_at_construction() -> None:
    """top_k -1 and one stop string set after construction mean what they mean in the
    constructor (the recheck used to refuse them: "top_k must be 0 or -1 ..., got -1")."""
    p = SamplingParams()
    p.top_k, p.stop = -1, "abc"
    p.check()
    assert (p.top_k, p.stop) == (0, ["abc"])
    # vLLM's defaults for the stop lists are None: None means none (it used to be refused)
    p = SamplingParams(stop=None, stop_token_ids=None)
    assert (p.stop, p.stop_token_ids) == ([], [])
    with pytest.raises(InvalidParamError) as e:
        SamplingParams(top_k=-1.0)  # was taken as -1, then 0
    assert e.value.param == "top_k"


def test_chat_refuses_lone_surrogates(llm: LLM) -> None:
    conversations = [[{"role": "user", "content": "Hi"}],
                     [{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]]
    with pytest.raises(InvalidParamError) as e:
        llm.chat(conversations, use_tqdm=False)
    assert e.value.param == "messages.1.0.content.0.text" and _idle(llm)


def test_token_controls_through_the_python_api(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    forced = tok.encode(" blue", add_special_tokens=False)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                    logit_bias={forced: 100}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [forced] * 4
    out = llm.generate("The sky is", SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=1,
                                                    allowed_token_ids=[forced, 11]), use_tqdm=False)
    assert set(out[0].outputs[0].token_ids) <= {forced, 11}
    plain = llm.generate("The sky is", greedy, use_tqdm=False)[0].outputs[0]
    word = plain.text.split()[0]
    banned = llm.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                       bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != plain.token_ids[0]
    assert _idle(llm)


# -- found by a hostile-client pass (issue 12) ---------------------------------------------------
def test_largest_seed_with_n_above_one(llm: LLM) -> None:
    # Sample i is seeded with seed + i, wrapped to 64 bits: a valid seed never becomes a 400.
    params = SamplingParams(n=2, seed=2**63 - 1, temperature=1.0, max_tokens=3, ignore_eos=True)
    out = llm.generate("Hello", params, use_tqdm=False)[0].outputs
    wrapped = llm.generate("Hello", SamplingParams(seed=-(2**63), temperature=1.0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert len(out) == 2 and out[1].token_ids == wrapped.token_ids


@pytest.mark.parametrize("prompts", [
    None, 5, {"prompt": [1, 2]}, {"prompt_token_ids": "Hi"}, {"prompt": "Hi", "multi_modal_data": {}},
    ["Hi", {"prompt_token_ids": [1, 2], "prompt": 5}], {"prompt_token_ids": [1, True]},
    {"prompt_token_ids": [1, 2], "cache_salt": "x", "mm_processor_kwargs": {}},
])
def test_generate_refuses_what_is_not_a_prompt(llm: LLM, prompts: object) -> None:
    with pytest.raises(InvalidParamError) as e:
        llm.generate(prompts, use_tqdm=False)
    assert e.value.param == "prompt" and _idle(llm)


def test_generate_takes_vllm_prompt_dicts(llm: LLM) -> None:
    # TextPrompt and TokensPrompt, alone or in a list with plain prompts: the same outputs.
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ids = llm.get_tokenizer().encode("The sky is")
    plain = llm.generate(["The sky is", ids], greedy, use_tqdm=False)
    dicts = llm.generate([{"prompt": "The sky is"}, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    one = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    assert dicts[0].prompt == "The sky is" and dicts[1].prompt_token_ids == ids and _idle(llm)


def test_a_row_with_every_token_banned_fails_alone(llm: LLM) -> None:
    # allowed_token_ids = only EOS, masked while below min_tokens: nothing can be sampled. The
    # sampler used to return a banned token (argmax of an all -inf row is token 0).
    eos = llm.engine.processor.eos_token_ids[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    alone = llm.generate("The sky is", greedy, use_tqdm=False)[0].outputs[0]
    for temperature in (0.0, 1.0):
        banned = SamplingParams(temperature=temperature, max_tokens=4, min_tokens=3, allowed_token_ids=[eos])
        good, bad = llm.generate(["The sky is", "Hi"], [greedy, banned], use_tqdm=False)
        assert bad.outputs[0].finish_reason == "error" and "no token can be sampled" in bad.outputs[0].error
        assert bad.outputs[0].token_ids == []
        assert good.outputs[0].token_ids == alone.token_ids
    assert _idle(llm) and llm.engine.core.kv_cache.usage == 0.0


def test_stop_token_text_follows_include_stop_str_in_output(llm: LLM) -> None:
    # vLLM: the token that ends a request (a stop_token_id, or EOS) is in token_ids, but its text is
    # in the output only with include_stop_str_in_output.
    tok = llm.get_tokenizer()
    plain = llm.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    stop_id = plain.token_ids[1]
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[stop_id],
                                include_stop_str_in_output=include)
        out = llm.generate("The sky is", params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == plain.token_ids[:2] and out.finish_reason == "stop" and out.stop_reason == stop_id
        assert out.text == tok.decode(plain.token_ids[: 2 if include else 1])


def test_bad_words_are_capped() -> None:
    """Every word is matched against every sequence each step: a long list would slow everyone."""
    from pagedllm.sampling_params import MAX_BAD_WORDS

    SamplingParams(bad_words=["w"] * MAX_BAD_WORDS)
    with pytest.raises(InvalidParamError) as e:
        SamplingParams(bad_words=["w"] * (MAX_BAD_WORDS + 1))
    assert e.value.param == "bad_words"


# -- found by a hostile offline-user pass ----------------------------------------------------------
@pytest.mark.parametrize(("params", "lora", "param"), [
    ([], None, "sampling_params"),  # used to run SamplingParams() as if None had been passed
    ({"temperature": 0}, None, "sampling_params"),  # used to name each key "expected SamplingParams, got str"
    (5, None, "sampling_params"),  # used to be a TypeError from len()
    (None, 5, "lora_request"),
    ([SamplingParams()] * 3, None, "sampling_params"),
    (None, [None] * 3, "lora_request"),
])
def test_generate_refuses_what_is_not_one_per_prompt(llm: LLM, params: object, lora: object, param: str) -> None:
    with pytest.raises(InvalidParamError) as e:
        llm.generate(["Hello", "Bye"], params, use_tqdm=False, lora_request=lora)
    assert e.value.param == param and _idle(llm)


@pytest.mark.parametrize(("messages", "kwargs", "param"), [
    (None, {}, "messages"),  # was a TypeError: not iterable
    ({"role": "user", "content": "Hi"}, {}, "messages"),  # one message, not in a list: was KeyError 0
    ([{"role": "user", "content": ["Hi"]}], {}, "messages.0.content.0"),  # a str part: the template's TypeError
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, "messages.0.content.0.type"),
    ([{"role": "user", "content": [{"text": "Hi"}]}], {}, "messages.0.content.0.type"),
    ([[{"role": "user", "content": "Hi"}]] * 2, {"chat_template": "{{ raise_exception('no') }}"}, "messages.0"),
    ([{"role": "user", "content": "Hi"}], {"chat_template": "{% for %}"}, "messages"),
    ([{"role": "user", "content": "Hi"}], {"chat_template": 5}, "chat_template"),  # was named "messages"
])
def test_chat_refuses_malformed_messages(llm: LLM, messages: object, kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidParamError) as e:
        llm.chat(messages, use_tqdm=False, **kwargs)
    assert e.value.param == param and _idle(llm) and llm.engine.core.kv_cache.usage == 0.0
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2  # the engine still serves


def test_generate_interrupted_mid_step_leaves_the_engine_whole(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C between the scheduler's step and its update used to leave the interrupted requests
    # queued half-stepped: the next generate ran them and failed in the decode kernel's spans.
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    alone = llm.generate("The sky is", greedy, use_tqdm=False)[0].outputs[0].token_ids
    executor, calls = llm.engine.core.executor, []
    execute = executor.execute

    def interrupted(sched):
        calls.append(1)
        if len(calls) == 3:  # after a prefill and a decode step
            raise KeyboardInterrupt
        return execute(sched)

    monkeypatch.setattr(executor, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Count to a hundred:", "Hello"], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert _idle(llm) and llm.engine.core.kv_cache.usage == 0.0
    assert llm.generate("The sky is", greedy, use_tqdm=False)[0].outputs[0].token_ids == alone


def test_a_failing_progress_bar_leaves_nothing_queued(llm: LLM) -> None:
    """A use_tqdm maker that raises: its call's requests were queued and stayed there, so the
    next generate ran them first."""
    long = SamplingParams(max_tokens=50, ignore_eos=True)
    with pytest.raises(ZeroDivisionError):
        llm.generate(["A" * 10, "B"], long, use_tqdm=lambda **bar_args: 1 / 0)
    assert _idle(llm) and llm.engine.core.kv_cache.usage == 0.0


def test_generate_inside_generate_is_refused_and_threads_take_turns(llm: LLM) -> None:
    """A call from inside a running one (its bar's callback) took that call's outputs and
    failed with a KeyError; two threads' calls interleaved their steps and failed in the
    decode kernel. Now the first is refused, the second run one after the other."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(["The sky is", "One, two,"], greedy, use_tqdm=False)]
    errors: list[BaseException] = []

    class Bar:
        def __init__(self, **bar_args: object) -> None:
            pass

        def update(self, n: int) -> None:
            try:
                llm.generate("nested", greedy, use_tqdm=False)
            except RuntimeError as e:
                errors.append(e)

        def set_postfix_str(self, text: str) -> None:
            pass

        def close(self) -> None:
            pass

    outs = llm.generate(["The sky is", "One, two,"], greedy, use_tqdm=Bar)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert len(errors) == 2 and "inside a running call" in str(errors[0])
    results: list[list] = [[], []]

    def run(k: int) -> None:
        for _ in range(3):
            results[k].append([o.outputs[0].token_ids for o in llm.generate(["The sky is", "One, two,"], greedy,
                                                                             use_tqdm=False)])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[alone] * 3, [alone] * 3] and _idle(llm)

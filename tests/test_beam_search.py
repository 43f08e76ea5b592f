"""``LLM.beam_search``, vLLM's offline beam search (was missing: AttributeError): width 1 is
greedy decoding, beams come best first with consistent scores, EOS finishes a beam, the
context's end stops one, and bad parameters are refused before any step runs."""

from __future__ import annotations

import pytest

from pagedllm import LLM, BeamSearchParams, LoRARequest, SamplingParams
from pagedllm.entrypoints.beam_search import beam_search_score
from pagedllm.errors import InvalidParamError

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=256)


def test_width_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0),
                          use_tqdm=False)[0]
    beam = llm.beam_search(PROMPT, BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))[0].sequences
    assert len(beam) == 1 and beam[0].tokens == greedy.prompt_token_ids + greedy.outputs[0].token_ids
    assert beam[0].cum_logprob == pytest.approx(greedy.outputs[0].cumulative_logprob, abs=1e-3)
    assert beam[0].text == greedy.outputs[0].text and beam[0].finish_reason == "length"


def test_beams_best_first_with_their_scores(llm: LLM) -> None:
    eos = set(llm.engine.processor.eos_token_ids)
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    narrow, wide = (llm.beam_search([{"prompt": PROMPT}], BeamSearchParams(beam_width=w, max_tokens=8))[0].sequences
                    for w in (1, 3))
    assert len(wide) == 3 and len({tuple(s.tokens) for s in wide}) == 3
    scores = [beam_search_score(s.tokens, s.cum_logprob, eos, 1.0) for s in wide]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] >= beam_search_score(narrow[0].tokens, narrow[0].cum_logprob, eos, 1.0)
    tok = llm.get_tokenizer()
    for s in wide:
        generated = s.tokens[len(prompt_ids):]
        assert s.tokens[: len(prompt_ids)] == prompt_ids and len(generated) == len(s.logprobs) <= 8
        assert s.cum_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(s.logprobs, generated)), abs=1e-4)
        stopped = generated[-1] in eos
        assert s.finish_reason == ("stop" if stopped else "length")
        assert s.text == tok.decode(generated[:-1] if stopped else generated)


def test_eos_finishes_a_beam(llm: LLM) -> None:
    chat = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    eos = llm.engine.processor.eos_token_ids
    prompt = {"prompt_token_ids": chat.prompt_token_ids}
    plain, shown = (llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=48, include_stop_str_in_output=s))[0]
                    for s in (False, True))
    for a, b in zip(plain.sequences, shown.sequences, strict=True):
        assert a.finish_reason == "stop" and a.tokens[-1] in eos and a.tokens == b.tokens
        assert b.text == a.text + llm.get_tokenizer().decode(a.tokens[-1:])
    ignored = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))[0].sequences
    assert all(s.finish_reason == "length" and len(s.tokens) == len(chat.prompt_token_ids) + 6 for s in ignored)


def test_the_context_end_stops_a_beam(llm: LLM) -> None:
    ids = list(range(100, 352))  # 252 of max_model_len 256
    out = llm.beam_search(ids, BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True))[0].sequences
    assert [len(s.tokens) for s in out] == [256, 256] and {s.finish_reason for s in out} == {"length"}


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=11, max_tokens=4), "beam_width"),  # 22 logprobs: past MAX_LOGPROBS
        (dict(beam_width=True, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, temperature=2.5), "temperature"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
        (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_bad_params_are_refused(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidParamError) as e:
        BeamSearchParams(**kwargs)
    assert e.value.param == param


def test_bad_input_is_refused_before_any_step(llm: LLM) -> None:
    with pytest.raises(InvalidParamError) as e:
        llm.beam_search(PROMPT, SamplingParams())
    assert e.value.param == "params"
    with pytest.raises(InvalidParamError) as e:  # the second prompt fills the context: nothing runs
        llm.beam_search([PROMPT, list(range(1, 300))], BeamSearchParams(beam_width=2, max_tokens=4))
    assert e.value.param == "prompt" and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompts,lora_request",
    [
        ([PROMPT, PROMPT], [None]),  # one adapter for two prompts
        (PROMPT, "an-adapter"),  # not a LoRARequest
        ([PROMPT, PROMPT], [LoRARequest("a", 1, "/a"), LoRARequest("b", 1, "/b")]),  # one id, two adapters
        (None, None),  # not a prompt
    ],
)
def test_prompts_and_adapters_are_checked_as_generate_checks_them(llm: LLM, prompts, lora_request) -> None:
    """The prompts and ``lora_request`` go through ``LLM.generate``'s own checks, before any step."""
    with pytest.raises(InvalidParamError) as e:
        llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=4), lora_request=lora_request)
    assert e.value.param == ("prompt" if prompts is None else "lora_request")
    assert not llm.engine.has_unfinished_requests()

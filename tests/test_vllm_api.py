"""vLLM's offline API where pagedllm lacked or changed it: ``SamplingParams.clone``,
``truncate_prompt_tokens`` and ``spaces_between_special_tokens``; prompt dicts' "prompt" text
and "cache_salt"; ``LLM.chat``'s parameters in vLLM's order, with its content format."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.errors import InvalidParamError
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=256)


def _idle(llm: LLM) -> bool:
    """Nothing queued or running."""
    return not llm.engine.has_unfinished_requests()


def test_clone_is_a_deep_copy() -> None:
    """vLLM's ``SamplingParams.clone`` (was missing)."""
    p = SamplingParams(stop=["a"], logit_bias={3: 1.0}, temperature=0.5)
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[4] = 2.0
    assert q != p and p == SamplingParams(stop=["a"], logit_bias={3: 1.0}, temperature=0.5)


def test_prompt_dicts_take_vllms_prompt_text_and_cache_salt(llm: LLM) -> None:
    """vLLM's TokensPrompt may give its ids' "prompt" text (the output's ``prompt``), and either
    dict a "cache_salt" (both were refused): a salted prompt shares prefix-cache entries only
    with prompts of the same salt. ``LLM.reset_prefix_cache`` empties the cache."""
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    text = "A long shared preamble about the sky, the sea and the mountains, told twice over. " * 2
    ids = llm.get_tokenizer().encode(text)
    plain = llm.generate({"prompt_token_ids": ids, "prompt": text}, greedy, use_tqdm=False)[0]
    assert plain.prompt == text and plain.prompt_token_ids == ids
    again = llm.generate([{"prompt": text}, {"prompt": text, "cache_salt": "alice"}], greedy, use_tqdm=False)
    assert again[0].num_cached_tokens > 0 and again[1].num_cached_tokens == 0  # another salt: no hit
    salted = llm.generate({"prompt_token_ids": ids, "cache_salt": "alice"}, greedy, use_tqdm=False)[0]
    assert salted.num_cached_tokens > 0 and salted.outputs[0].token_ids == plain.outputs[0].token_ids
    assert llm.reset_prefix_cache()  # vLLM's (was missing): nothing cached afterwards
    assert llm.generate({"prompt": text}, greedy, use_tqdm=False)[0].num_cached_tokens == 0
    for salt in ("", 5):
        with pytest.raises(InvalidParamError) as e:
            llm.generate({"prompt": text, "cache_salt": salt}, greedy, use_tqdm=False)
        assert e.value.param == "cache_salt" and _idle(llm)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm: LLM) -> None:
    """vLLM's truncate_prompt_tokens (was an unknown field: TypeError): k keeps the prompt's last
    k tokens, text or ids alike, the output as for those tokens given whole; -1 keeps the last
    max_model_len (a prompt past it then runs instead of being refused); above max_model_len
    it is refused, naming the field."""
    ids = llm.get_tokenizer().encode("The sky is blue and the grass is green because of")
    greedy = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
    whole = llm.generate({"prompt_token_ids": ids[-4:]}, SamplingParams(**greedy), use_tqdm=False)[0]
    cut = SamplingParams(**greedy, truncate_prompt_tokens=4)
    text, tokens = llm.generate(["The sky is blue and the grass is green because of", ids], cut, use_tqdm=False)
    for out in (text, tokens):
        assert out.prompt_token_ids == ids[-4:] and out.outputs[0].token_ids == whole.outputs[0].token_ids
    assert text.prompt == "The sky is blue and the grass is green because of"
    short = llm.generate(ids[:3], cut, use_tqdm=False)[0]  # shorter than k: kept whole
    assert short.prompt_token_ids == ids[:3]
    long = list(range(5, 5 + 300))  # past max_model_len 256
    with pytest.raises(InvalidParamError) as e:
        llm.generate(long, SamplingParams(**greedy), use_tqdm=False)
    assert e.value.param == "prompt"
    capped = llm.generate(long, SamplingParams(**greedy, truncate_prompt_tokens=200), use_tqdm=False)[0]
    assert capped.prompt_token_ids == long[-200:] and len(capped.outputs[0].token_ids) == 3
    with pytest.raises(InvalidParamError) as e:
        llm.generate(ids, SamplingParams(**greedy, truncate_prompt_tokens=257), use_tqdm=False)
    assert e.value.param == "truncate_prompt_tokens" and "256" in str(e.value) and _idle(llm)
    # -1: the last max_model_len tokens, which leave no room for output: refused as any such prompt.
    with pytest.raises(InvalidParamError) as e:
        llm.generate(long, SamplingParams(**greedy, truncate_prompt_tokens=-1), use_tqdm=False)
    assert e.value.param == "prompt" and "256 tokens" in str(e.value) and _idle(llm)


def test_chat_takes_vllms_arguments_in_vllms_order(llm: LLM) -> None:
    """``LLM.chat``'s parameters are vLLM's, in its order (lora_request was fifth and
    add_generation_prompt fourth: a positional vLLM call was refused or misread), and vLLM's
    ``chat_template_content_format`` picks how contents reach the template (was a TypeError)."""
    conversation = [{"role": "user", "content": "Hi"}]
    shows = "{% for m in messages %}[{{ m.content is string }}]{% endfor %}"
    params = SamplingParams(max_tokens=1)
    out = llm.chat(conversation, params, False, None, shows)[0]  # vLLM: ..., lora_request, chat_template
    assert out.prompt == "[True]"
    for content_format, string in (("auto", True), ("string", True), ("openai", False)):
        out = llm.chat(conversation, params, False, None, shows, content_format)[0]
        assert out.prompt == f"[{string}]"
    out = llm.chat(conversation, params, use_tqdm=False, chat_template=shows, add_generation_prompt=True)[0]
    assert out.prompt == "[True]"
    with pytest.raises(InvalidParamError) as e:
        llm.chat(conversation, params, use_tqdm=False, chat_template_content_format="parts")
    assert e.value.param == "chat_template_content_format" and _idle(llm)


def test_spaces_between_special_tokens_is_accepted_and_decoding_is_the_fast_tokenizers(llm: LLM) -> None:
    """vLLM's field (was a TypeError): with fast tokenizers, as vLLM's fast detokenizer, special
    tokens are written with no spaces between them whatever it says."""
    tok = llm.get_tokenizer()
    specials = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    texts = []
    for spaces in (True, False):
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, allowed_token_ids=specials,
                                skip_special_tokens=False, spaces_between_special_tokens=spaces)
        out = llm.generate("Hi", params, use_tqdm=False)[0].outputs[0]
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=False) and " " not in out.text
        texts.append(out.text)
    assert texts[0] == texts[1]


def test_vllm_only_keywords_say_what_to_use_instead() -> None:
    """vLLM scripts pass LLM(gpu_memory_utilization=..., enforce_eager=...): refused before
    anything loads, naming LLM and, for each vLLM-only keyword, what to do here (the words
    the command line gives for its flags); an unknown keyword is named too."""
    with pytest.raises(TypeError, match=r"LLM\(\) got unexpected keyword arguments: enforce_eager, "
                       r"gpu_memory_utilization, no_such_setting; enforce_eager: nothing is captured .*"
                       r"; gpu_memory_utilization: the KV cache is sized in bytes here, by kv_cache_memory"):
        LLM(gpu_memory_utilization=0.9, enforce_eager=True, no_such_setting=1)
    with pytest.raises(TypeError, match=r"enable_chunked_prefill: prefill is always chunked here, by the step's token "
                       r"budget: max_num_batched_tokens"):
        LLM(enable_chunked_prefill=False)


def test_engine_config_keywords_are_taken_as_given() -> None:
    """Every EngineConfig field is an LLM keyword: live_view (which trace also sets) was a
    TypeError naming EngineConfig.__init__ ("multiple values"), and quantize_lm_head=False
    under dtype auto was silently replaced by auto's True; both are now taken as given."""
    llm = LLM(kv_cache_memory="64MiB", max_model_len=64, live_view=True, quantize_lm_head=False)
    config = llm.engine.core.config
    assert config.live_view and not config.quantize_lm_head
    assert type(llm.engine.core.executor.runner.model.lm_head).__name__ not in ("Q8A8Linear", "KQuantLinear")
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()

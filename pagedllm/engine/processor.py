"""Front-end input processing: validate, tokenize, fan a request out into ``n`` samples."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import msgspec

from pagedllm.engine.lora_check import LoRAChecker
from pagedllm.engine.malloc_trim import trim_after_text
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.errors import InvalidParamError
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import SamplingParams, check_text
from pagedllm.structured_output import backend

# A prompt: text, token ids, or vLLM's prompt dicts, {"prompt": text} (TextPrompt) and
# {"prompt_token_ids": ids} (TokensPrompt, which may also give the ids' "prompt" text), either
# with a "cache_salt"; a dict with any other key (multi_modal_data, ...) is refused.
PromptType = str | Sequence[int] | Mapping[str, object]


def _unwrap(prompt: Mapping[str, object]) -> tuple[str | None, object]:
    """(the output's prompt text, what to tokenize: the text of a TextPrompt dict, the ids of a
    TokensPrompt dict, checked by the caller); its "cache_salt" is ``prompt_cache_salt``'s."""
    keys = set(prompt) - {"cache_salt"}
    text = prompt.get("prompt")
    ids = prompt.get("prompt_token_ids")
    if keys == {"prompt"} and isinstance(text, str):
        return text, text
    if keys <= {"prompt_token_ids", "prompt"} and "prompt_token_ids" in keys and not isinstance(ids, (str, Mapping)):
        if text is not None:
            check_text(text, "prompt")
        return text, ids
    raise InvalidParamError(
        "prompt", 'a prompt dict holds "prompt" (a str) or "prompt_token_ids" (a list of int, with or without its '
        f'"prompt" text), and "cache_salt" (a str) if any; got {prompt!r:.80}'
    )


def prompt_cache_salt(prompt: PromptType, cache_salt: str | None = None) -> str | None:
    """``cache_salt`` if given, else a prompt dict's "cache_salt" (vLLM's: the prompt's prefix-cache
    entries are shared only with requests of the same salt); None for other prompts.

    Raises:
        InvalidParamError (param "cache_salt"): a dict's salt that is not a non-empty str.
    """
    if cache_salt is not None or not isinstance(prompt, Mapping) or "cache_salt" not in prompt:
        return cache_salt
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise InvalidParamError("cache_salt", f"cache_salt must be a non-empty string, got {salt!r:.80}")
    return check_text(salt, "cache_salt")


class Processor:
    """Turns user prompts into engine-core requests; raises ValueError on bad input.

    Args:
        tokenizer: a transformers tokenizer.
        max_model_len: longest prompt + output the engine serves.
        vocab_size: token ids must lie in [0, vocab_size).
        eos_token_ids: ids that end generation unless ``ignore_eos``.
        lora: the check of requests' LoRA adapters (None: a request naming one fails).
        kv_limited: whether ``max_model_len`` is the KV cache's capacity (``KVCacheConfig.kv_limited``),
            which the errors then name instead of the model's context.
        cap_max_tokens: a prompt + ``max_tokens`` past ``max_model_len`` runs until the sequence
            reaches it (finish_reason "length"), as vLLM's offline ``LLM`` does; False: refused
            (``max_tokens``), as vLLM's OpenAI server does.
    """

    def __init__(
        self, tokenizer, max_model_len: int, vocab_size: int, eos_token_ids: list[int], lora: LoRAChecker | None = None,
        kv_limited: bool = False, cap_max_tokens: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.cap_max_tokens = cap_max_tokens
        self.lora = lora
        self.max_model_len = max_model_len
        self.limit_name = (
            "the maximum context length the KV cache holds (kv_cache_memory, --kv-cache-memory)" if kv_limited
            else "this model's maximum context length"
        )
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids). Text is tokenized as the model expects (BOS if any);
        a TokensPrompt's ids are taken as given, its "prompt" (if any) as their text.

        Raises:
            InvalidParamError (a ValueError, param "prompt"): text that is not Unicode scalar
                values, a prompt that is neither a str nor a sequence of int token ids, or a
                prompt dict other than {"prompt": str} and {"prompt_token_ids": ids, "prompt":
                str}, each with a "cache_salt" or not.
        """
        text = None
        if isinstance(prompt, Mapping):
            text, prompt = _unwrap(prompt)
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(check_text(prompt, "prompt"))
            trim_after_text(len(prompt))
            return prompt, ids
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence) or any(
            isinstance(t, bool) or not isinstance(t, int) for t in prompt
        ):
            raise InvalidParamError("prompt", f"a prompt must be a str or a list of int token ids, got {prompt!r:.80}")
        return text, list(prompt)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """The token sequences ``bad_words`` bans, as vLLM tokenizes them: each word as given
        (leading spaces stripped) and with one leading space, the latter only where that gives
        a different first token and as many tokens (the word's spelling mid-sentence)."""
        sequences: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            sequences.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
                sequences.append(spaced)
        return sequences

    def _check_vocab(self, field: str, token_ids: Sequence[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParamError(field, f"{field}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[EngineCoreRequest]:
        """Validate one request and return its ``n`` engine-core requests ("{id}-{i}").

        ``params.truncate_prompt_tokens`` first cuts the prompt to its last k tokens (-1: the
        last ``max_model_len``), as vLLM; the core requests carry the tokens kept.

        Raises:
            InvalidParamError (a ValueError naming the field): truncate_prompt_tokens above
                max_model_len, empty prompt, token ids outside
                the vocabulary (prompt, stop_token_ids, logit_bias, allowed_token_ids), a
                prompt that leaves no room for output within max_model_len (``prompt``), a
                prompt + max_tokens beyond it unless ``cap_max_tokens`` (``max_tokens``; the
                messages give the numbers),
                ``structured_outputs`` that do not compile (``structured_outputs.json``, ...),
                or a ``lora_request`` with LoRA disabled.
            LoRAError (a ValueError): an adapter that cannot be read or does not fit the model.
        """
        if not isinstance(params, SamplingParams):
            raise InvalidParamError("sampling_params", f"expected SamplingParams, got {type(params).__name__}")
        params.check()
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if keep > self.max_model_len:
                raise InvalidParamError(
                    "truncate_prompt_tokens", f"truncate_prompt_tokens ({keep}) must be at most {self.limit_name} "
                    f"of {self.max_model_len} tokens (or -1)"
                )
            prompt_token_ids = prompt_token_ids[-keep:]
        n_prompt = len(prompt_token_ids)
        if n_prompt == 0:
            raise InvalidParamError("prompt", "the prompt is empty: it must have at least 1 token")
        self._check_vocab("prompt", prompt_token_ids)
        self._check_vocab("stop_token_ids", params.stop_token_ids)
        self._check_vocab("logit_bias", list(params.logit_bias or {}))
        self._check_vocab("allowed_token_ids", params.allowed_token_ids or [])
        if params.structured_outputs is not None:  # nothing reaches the core that cannot compile
            try:
                backend.check(params.structured_outputs)
            except InvalidParamError as e:
                raise InvalidParamError(f"structured_outputs.{e.param}", str(e)) from None
        if lora_request is not None:
            if self.lora is None:
                raise InvalidParamError("lora_request", "LoRA adapters are not enabled (--enable-lora)")
            self.lora.check(lora_request)
        if params.bad_words:
            params = msgspec.structs.replace(params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        max_tokens = params.max_tokens if params.max_tokens is not None else 1
        if n_prompt + min(max_tokens, 1) > self.max_model_len:  # no room even for the least output
            than = "longer than" if n_prompt > self.max_model_len else "leaving no room for output in"
            raise InvalidParamError(
                "prompt",
                f"the prompt is {n_prompt} tokens, {than} {self.limit_name} of {self.max_model_len} tokens",
            )
        if n_prompt + max_tokens > self.max_model_len and not self.cap_max_tokens:
            raise InvalidParamError(
                "max_tokens",
                f"{self.limit_name} is {self.max_model_len} tokens, but "
                f"{n_prompt} prompt tokens + {max_tokens} max_tokens = {n_prompt + max_tokens} were requested"
            )
        now = time.monotonic()
        requests = []
        for i in range(params.n):
            child = params
            if params.n > 1:  # each sample its own request; seeds differ so samples differ
                # Wrapped to a signed 64-bit value: seed 2**63 - 1 with n > 1 is valid input.
                seed = None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63
                child = msgspec.structs.replace(params, n=1, seed=seed)
                if i > 0 and params.max_tokens != 0:  # the output holds sample 0's prompt scores only
                    child = msgspec.structs.replace(child, prompt_logprobs=None)
            requests.append(
                EngineCoreRequest(
                    f"{request_id}-{i}", prompt_token_ids, child, self.eos_token_ids, now, cache_salt, lora_request
                )
            )
        return requests

"""Incremental detokenization of one request's output, with stop-string matching.

Text is produced by ``tokenizers``' ``DecodeStream`` (one native call per token): it decodes a
short window of recent ids and emits what the newest token adds, holding back bytes that do
not yet form a whole UTF-8 character. Decoding a window (rather than one token alone) keeps
context-dependent decoders right: sentencepiece decoders drop the leading space of the first
token they see, and a byte-level BPE token may carry half a UTF-8 character. Each step costs
O(window), not O(output length).
"""

from __future__ import annotations

import bisect
import re
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pagedllm.sampling_params import SamplingParams

# What a decoder yields for bytes that do not (yet) form a whole UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output so that its first token is decoded in context.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a few tokens at a time.

    ``output_text`` holds the text so far. Text is withheld while the last tokens end inside a
    UTF-8 character; at the end ``flush()`` drops such an incomplete character, so the text
    never holds a U+FFFD that stands for bytes still to come. ``token_texts`` gives each token
    of the last ``update`` its share of the text: "" for a token that only starts a character,
    the whole character for the token that completes it.

    The first output token is decoded after the last few prompt tokens, as vLLM does, so
    ``output_text`` equals ``tokenizer.decode(output_ids)`` for byte-level BPE tokenizers, and
    for sentencepiece ones keeps the leading space that ``decode`` would strip from the
    first output token (``decode(prompt) + output_text == decode(prompt + output)``).

    Stop strings are searched across token boundaries, after each token. When several
    complete with the same token, the one that ends first wins (the longest of those ending at the same place), so
    the result does not depend on how the text was split into tokens. Matching starts with the
    token after the first ``min_tokens``, the first that EOS or a stop token id can be (vLLM's rule).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        """Prepare to detokenize the output of a request with these prompt ids and params.

        Args:
            tokenizer: a fast (``tokenizers``-backed) transformers tokenizer.
            params: checked (``SamplingParams.check``): stop strings only with ``detokenize``.
        """
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self.stop_reason: str | None = None
        self.num_output_tokens = 0
        self._max_stop_len = max(map(len, params.stop), default=0)
        self._stop_first_chars = {stop[0] for stop in params.stop}
        self._sorted_stops = sorted(params.stop)  # the stops that start with a given text are consecutive
        self._finished = False
        self._num_sent = 0  # chars of output_text already returned by get_delta()
        self.token_texts: list[str] = []  # per token of the last update(): the text it added

        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: output bytes completing it would rewrite the
            # context's text, so decode the output on its own instead.
            context, context_text = [], ""
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(context, skip_special_tokens=params.skip_special_tokens)
        self._pending: list[int] = []  # output ids since the stream last emitted text

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append output tokens and extend ``output_text``.

        ``stop_terminated``: the last token ended the request (EOS or one of
        ``stop_token_ids``); as in vLLM, its text is left out of ``output_text`` unless
        ``include_stop_str_in_output`` (it still counts as an output token, its share "").

        Returns:
            The stop string that matched, else None. On a match ``output_text`` is cut right
            before the stop string (right after it with ``include_stop_str_in_output``), and
            the caller must finish the request with reason "stop"; call no further updates.
            Then ``num_output_tokens`` counts the output only up to the token that completed
            the stop string: tokens after it in the same update (accepted speculative
            drafts) are not part of the output, exactly as if they had come one at a time.
        """
        self.token_texts = []
        if not self.params.detokenize:
            self.num_output_tokens += len(new_token_ids)
            return None
        skipped = stop_terminated and not self.params.include_stop_str_in_output and bool(new_token_ids)
        for j, token_id in enumerate(new_token_ids):
            self.num_output_tokens += 1
            if skipped and j == len(new_token_ids) - 1:
                self.token_texts.append("")
                break
            old_len = len(self.output_text)
            delta = self._decode_step(token_id)
            self.token_texts.append(delta)
            self.output_text += delta
            matching = self.params.stop and self.num_output_tokens > self.params.min_tokens
            if matching and (stop := self._match_stop(old_len)) is not None:
                return stop
        return None

    def get_delta(self) -> str:
        """Return the text not yet returned by earlier calls, for streaming.

        Until the request finishes, a tail that could begin a stop string is withheld, so a
        client never sees text that a later match cuts off.
        """
        end = len(self.output_text)
        if not self._finished and not self.params.include_stop_str_in_output:
            end -= self._stop_prefix_len()
        delta = self.output_text[self._num_sent : end]
        self._num_sent += len(delta)
        return delta

    def flush(self) -> str:
        """Finish the text (the request ended by length, EOS or error); return the final delta.

        Tokens held back for ending inside a character stay out: the text ends on the last
        complete character (their text shares stay ""). The stop-string tail is released.
        """
        if not self._finished and self._pending:
            # Whatever completes before the unfinished character still counts.
            self.output_text += self._decode(self._pending).rstrip(_REPLACEMENT_CHAR)
        self._finished = True
        return self.get_delta()

    def _decode(self, token_ids: list[int]) -> str:
        # No clean-up: it rewrites " ." and the like, so a window's text would stop being a
        # prefix of the next window's text.
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_step(self, token_id: int) -> str:
        """The text ``token_id`` adds after the tokens before it: "" while it ends inside a
        character or decodes to nothing (a skipped special token)."""
        delta = self._stream.step(self._backend, token_id)
        if not delta:
            self._pending.append(token_id)
            return ""
        self._pending.clear()
        return delta

    def _match_stop(self, old_len: int) -> str | None:
        """Find the first stop string completed by text after ``old_len``; cut the text there."""
        text = self.output_text
        matches: list[tuple[int, int, str]] = []
        for stop in self.params.stop:
            # Start far enough back to catch a stop string split across updates.
            start = text.find(stop, max(0, old_len - len(stop) + 1))
            if start >= 0:
                matches.append((start + len(stop), -len(stop), stop))
        if not matches:
            return None
        end, neg_len, stop = min(matches)  # ends first; the longest of those ending there
        self.output_text = text[: end if self.params.include_stop_str_in_output else end + neg_len]
        self.stop_reason = stop
        self._finished = True
        return stop

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of ``output_text`` that is a proper prefix of a stop.

        Runs every step: it looks only at the last ``longest stop - 1`` characters, and tests
        each position against the one stop that sorts first at or after its tail (if any stop
        starts with the tail, that one does), so a step costs O(longest stop x log(stops)).
        """
        text = self.output_text
        stops = self._sorted_stops
        for start in range(max(0, len(text) - self._max_stop_len + 1), len(text)):
            if text[start] in self._stop_first_chars:  # skips most positions cheaply
                tail = text[start:]
                i = bisect.bisect_left(stops, tail)
                if i < len(stops) and stops[i].startswith(tail):
                    return len(text) - start
        return 0


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL_CHARS = _bytes_to_unicode()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """The raw bytes of each token id (cached), for OpenAI's logprob ``bytes`` field.

    Byte-level BPE tokens (GPT-2 alphabet) map back to their bytes and sentencepiece
    byte-fallback tokens (``<0xE2>``) to their one byte, so a token holding part of a
    character gives that part; other tokens give the UTF-8 of their decoded text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        # The decoder's own JSON (tokenizers pickles a decoder as it), not the whole tokenizer's:
        # serializing a 50k vocabulary and its merges took a quarter of a second of every start.
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if m := _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(m[1], 16)])
            if self._byte_level and all(c in _BYTE_LEVEL_CHARS for c in piece):
                return bytes(_BYTE_LEVEL_CHARS[c] for c in piece)
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False).encode()


def token_shares(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> list[str]:
    """Each token's share of the text of ``token_ids`` decoded from the start, special tokens
    kept (as an echoed prompt is): "" for a token that ends inside a UTF-8 character, the whole
    character for the token that completes it, as ``IncrementalDetokenizer.token_texts``; the
    shares join to that text (less an unfinished character at the end)."""
    stream = DecodeStream([], skip_special_tokens=False)
    backend = tokenizer.backend_tokenizer
    return [stream.step(backend, token_id) or "" for token_id in token_ids]


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """A token's text out of context: "" when it holds only part of a UTF-8 character."""
    text = tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
    return "" if _REPLACEMENT_CHAR in text else text

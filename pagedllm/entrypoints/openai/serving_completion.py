"""``POST /v1/completions``: one engine request per prompt, ``n`` samples each."""

from __future__ import annotations

import asyncio

import time
from collections.abc import AsyncIterator

from pagedllm.engine.async_llm import PreparedRequest
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.detokenizer import token_shares
from pagedllm.engine.processor import PromptType
from pagedllm.entrypoints.openai.errors import generation_error
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.response_bodies import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.serving_engine import (
    MAX_N,
    SSE_DONE,
    OpenAIServing,
    gather_final,
    merge,
    num_output_tokens,
    sse,
    top_n,
)
from pagedllm.entrypoints.openai.structured_outputs import structured_outputs_field
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    """Handles completions requests, streaming or not."""

    async def create(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """A response, or the SSE lines of a stream.

        Raises:
            OpenAIError: 404 for another model, 400 for invalid input (before anything runs).
        """
        request_id = random_id("cmpl")
        # Validation (grammar checks, tokenizing) in a worker thread: the event loop serves everyone.
        prepared = await asyncio.to_thread(self._prepare_all, request_id, req)
        constraint_field = structured_outputs_field(req)
        if req.stream:
            return self._stream(req, request_id, prepared, constraint_field)
        outputs = await gather_final([self.engine.generate(p) for p in prepared])
        for out in outputs:
            if (error := generation_error(out, constraint_field)) is not None:
                raise error
        choices = [
            self._choice(req, out, c, prompt_idx * req.n + c.index, c.text, c.logprobs)
            for prompt_idx, out in enumerate(outputs)
            for c in out.outputs
        ]
        return CompletionResponse(
            id=request_id, model=self.response_model(req.model), choices=choices, usage=self._usage(prepared, outputs)
        )

    # -- input -----------------------------------------------------------------------------
    def _prepare_all(self, request_id: str, req: CompletionRequest) -> list[PreparedRequest]:
        """Validate and tokenize every prompt (blocking; 400 naming the field on invalid input)."""
        self.check_request(req)
        return [self._prepare(f"{request_id}-{i}", p, req) for i, p in enumerate(self._prompts(req))]

    @staticmethod
    def _prompts(req: CompletionRequest) -> list[str | list[int]]:
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        # The cap on n is per request, not per prompt: a 200-byte body of 20 prompts at n=256
        # would otherwise queue 5,120 sequences ahead of every other client.
        if len(p) * req.n > MAX_N:
            raise OpenAIError(
                400, f"at most {MAX_N} sequences per request (prompts x n), got {len(p)} x {req.n}", param="prompt"
            )
        return list(p)

    def _prepare(self, request_id: str, prompt: str | list[int], req: CompletionRequest) -> PreparedRequest:
        # echo + logprobs returns the prompt's logprobs too; with max_tokens 0 that is all it
        # returns, which is how evaluation harnesses score log-likelihoods.
        prompt_logprobs = None
        if req.echo and (req.logprobs is not None or req.max_tokens == 0):
            prompt_logprobs = req.logprobs or 0
        # An explicit null is the room the context leaves after the prompt (vLLM's), so a text
        # prompt is tokenized first and passed on as its ids; unset is the field's default, 16.
        engine_prompt: PromptType = prompt
        prompt_len = 0
        if req.max_tokens is None:
            ids = prompt
            if isinstance(prompt, str):
                try:
                    text, ids = self.engine.processor.tokenize(prompt)
                except ValueError as e:
                    raise OpenAIError.bad_request(e) from None
                engine_prompt = {"prompt_token_ids": ids, "prompt": text}
            prompt_len = len(ids)
        params = self.sampling_params(req, prompt_len, req.max_tokens, req.logprobs, prompt_logprobs)
        return self.prepare(request_id, engine_prompt, params, req.cache_salt, req.model)

    # -- running -----------------------------------------------------------------------------
    async def _stream(
        self, req: CompletionRequest, request_id: str, prepared: list[PreparedRequest], constraint_field: str | None
    ) -> AsyncIterator[str]:
        created = int(time.time())
        finished: set[int] = set()
        echoed: set[int] = set()
        offsets: dict[int, int] = {}  # per choice: the text_offset of its next token
        num_tokens: dict[int, int] = {}  # per choice: its tokens so far
        try:
            async for prompt_idx, out in merge([self.engine.generate(p, stream=True) for p in prepared]):
                if (error := generation_error(out, constraint_field)) is not None:
                    yield sse(error.body())
                    yield SSE_DONE
                    return  # leaving the merge aborts the other prompts
                events = []  # this output's events (one per choice), sent as one write
                for c in out.outputs:
                    index = prompt_idx * req.n + c.index
                    if index in finished:
                        continue
                    num_tokens[index] = num_tokens.get(index, 0) + len(c.token_ids)
                    text, logprobs = c.text, c.logprobs
                    if not (text or c.token_ids or c.finish_reason):
                        continue  # a prefill chunk that sampled nothing
                    if c.finish_reason is not None:
                        finished.add(index)
                    # The choice's first chunk carries the echoed prompt (its logprobs are complete by now).
                    echo = req.echo and index not in echoed
                    echoed.add(index)
                    choice = self._choice(req, out, c, index, text, logprobs, echo, offsets.get(index, 0))
                    if choice.logprobs is not None and choice.logprobs.tokens:
                        offsets[index] = choice.logprobs.text_offset[-1] + len(choice.logprobs.tokens[-1])
                    usage = None
                    if req.continuous_usage:
                        usage = UsageInfo.of(len(prepared[prompt_idx].prompt_token_ids), num_tokens[index])
                    events.append(sse(CompletionResponse(id=request_id, created=created,
                                                         model=self.response_model(req.model), choices=[choice],
                                                         usage=usage)))
                if events:
                    yield "".join(events)
            if req.include_usage:
                usage = UsageInfo.of(sum(len(p.prompt_token_ids) for p in prepared), sum(num_tokens.values()))
                yield sse(CompletionResponse(id=request_id, created=created,
                                             model=self.response_model(req.model), choices=[], usage=usage))
        except EngineDeadError as e:
            yield sse(OpenAIError(503, str(e), "ServiceUnavailableError").body())
        yield SSE_DONE

    # -- output ------------------------------------------------------------------------------
    def _choice(
        self,
        req: CompletionRequest,
        out: RequestOutput,
        c: CompletionOutput,
        index: int,
        text: str,
        logprobs: list[dict[int, Logprob]] | None,
        echo: bool | None = None,
        text_offset: int = 0,
    ) -> CompletionChoice:
        """One choice of ``text`` (after the prompt's text if ``echo``, default ``req.echo``);
        its logprobs' ``text_offset`` counts from ``text_offset``, the characters of this
        choice's tokens already sent (a stream's earlier chunks), so that a streamed choice's
        offsets equal the non-streamed ones."""
        echo = req.echo if echo is None else echo
        prompt_text = ""
        if echo:
            prompt_text = out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)
        lp = None
        if req.logprobs is not None:
            lp = CompletionLogprobs()
            if echo:
                # The first token's share of the prompt's text: "" for a special token the
                # tokenizer added (a BOS), which the prompt's text does not hold.
                first = token_shares(self.tokenizer, out.prompt_token_ids[:1])[0] if out.prompt_token_ids else ""
                first = first if prompt_text.startswith(first) else ""
                self._add_logprobs(lp, out.prompt_token_ids, out.prompt_logprobs or [], req.logprobs, text_offset, first)
            self._add_logprobs(lp, c.token_ids, logprobs or [], req.logprobs, text_offset + len(prompt_text))
        return CompletionChoice(index=index, text=prompt_text + text, logprobs=lp, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)

    def _add_logprobs(
        self, lp: CompletionLogprobs, token_ids: list[int], entries: list[dict[int, Logprob] | None], n: int,
        offset: int, first: str | None = None,
    ) -> None:
        """Append one entry per token, the first at text ``offset``. Each ``top_logprobs`` holds
        the sampled token and the ``n`` most likely ones, as OpenAI and vLLM: up to n + 1
        entries (with n = 0, the sampled token alone). The first prompt position has no
        logprob (nothing precedes it): None, as OpenAI; its string is ``first``, the caller's
        share of the prompt's text for it (None: the token's own, ``token_shares``), so that the
        tokens join to the text and ``text_offset`` indexes it."""
        for tid, entry in zip(token_ids, entries):
            chosen = None if entry is None else entry.get(tid)
            if entry is not None:
                token = self.token_str(tid, chosen)
            else:
                token = first if first is not None else token_shares(self.tokenizer, [tid])[0]
            lp.tokens.append(token)
            lp.token_logprobs.append(None if chosen is None else chosen.logprob)
            top = None
            if entry is not None:
                top = {} if chosen is None else {token: chosen.logprob}
                for t, v in top_n(entry, n):
                    top.setdefault(self.token_str(t, v), v.logprob)
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(token)

    @staticmethod
    def _usage(prepared: list[PreparedRequest], outputs: list[RequestOutput]) -> UsageInfo:
        return UsageInfo.of(sum(len(p.prompt_token_ids) for p in prepared), num_output_tokens(outputs))

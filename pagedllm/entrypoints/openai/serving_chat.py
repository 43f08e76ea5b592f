"""``POST /v1/chat/completions``: the model's chat template, then one engine request with ``n`` samples."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pagedllm.engine.async_llm import PreparedRequest
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.entrypoints.openai.errors import generation_error
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    gather_final,
    sse,
    top_n,
)
from pagedllm.outputs import Logprob


class OpenAIServingChat(OpenAIServing):
    """Handles chat completions requests, streaming or not."""

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation under the model's chat template (400 if the template refuses it)."""
        conversation = [
            {
                "role": m.role,
                "content": m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content or []),
            }
            for m in messages
        ]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # jinja raises its own errors for conversations a template rejects
            raise OpenAIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        # The template already wrote any special tokens the model expects.
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def create(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        """A response, or the SSE lines of a stream.

        Raises:
            OpenAIError: 404 for another model, 400 for invalid input (before anything runs).
        """
        self.check_request(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= 20:
                raise OpenAIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
        token_ids = self.render(req.messages, req.add_generation_prompt)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, len(token_ids), max_tokens, logprobs)
        request_id = random_id("chatcmpl")
        prepared = self.prepare(request_id, token_ids, params, req.cache_salt)
        if req.stream:
            return self._stream(req, prepared)
        (out,) = await gather_final([self.engine.generate(prepared)])
        if (error := generation_error(out)) is not None:
            raise error
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ]
        completion = sum(len(c.token_ids) for c in out.outputs)
        usage = UsageInfo(prompt_tokens=len(token_ids), completion_tokens=completion,
                          total_tokens=len(token_ids) + completion)
        return ChatCompletionResponse(id=request_id, model=self.served_model_name, choices=choices, usage=usage)

    async def _stream(self, req: ChatCompletionRequest, prepared: PreparedRequest) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=prepared.request_id, created=created, model=self.served_model_name,
                                           choices=choices, usage=usage))

        # OpenAI's streams open each choice with the role and an empty content.
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        completion_tokens = 0
        finished: set[int] = set()
        try:
            async for out in self.engine.generate(prepared, stream=True):
                if (error := generation_error(out)) is not None:
                    yield sse(error.body())
                    yield SSE_DONE
                    return  # leaving the stream aborts the other samples
                for c in out.outputs:
                    if c.index in finished or not (c.text or c.token_ids or c.finish_reason):
                        continue
                    completion_tokens += len(c.token_ids)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    logprobs = self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None
                    yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text), logprobs=logprobs,
                                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
            if req.include_usage:
                n_prompt = len(prepared.prompt_token_ids)
                yield chunk([], UsageInfo(prompt_tokens=n_prompt, completion_tokens=completion_tokens,
                                          total_tokens=n_prompt + completion_tokens))
        except EngineDeadError as e:
            yield sse(OpenAIError(503, str(e), "ServiceUnavailableError").body())
        yield SSE_DONE

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]] | None, n: int) -> ChatLogprobs:
        content = []
        for tid, entry in zip(token_ids, entries or []):
            chosen = entry[tid]
            token = self.token_str(tid, chosen)
            top = [
                TopLogprob(token=self.token_str(t, v), logprob=v.logprob, bytes=_bytes(self.token_str(t, v), v))
                for t, v in top_n(entry, n)
            ]
            content.append(TokenLogprob(token=token, logprob=chosen.logprob, bytes=_bytes(token, chosen),
                                        top_logprobs=top))
        return ChatLogprobs(content=content)


def _bytes(token: str, logprob: Logprob) -> list[int]:
    """The token's own raw bytes (part of a character for a token that splits one), as OpenAI."""
    return list(logprob.token_bytes if logprob.token_bytes is not None else token.encode())

"""A request the engine failed mid-generation, as an OpenAI error (vLLM's ``GenerationError``)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.serving_engine import OpenAIError
from pagedllm.outputs import RequestOutput


def generation_error(out: RequestOutput) -> OpenAIError | None:
    """A 500 InternalServerError if a sample of ``out`` finished with reason "error", else None.

    The request was valid (validation answers 400 before anything runs); the engine failed it
    alone and goes on serving the others, so this is the server's error, not the client's.
    """
    for c in out.outputs:
        if c.finish_reason == "error":
            return OpenAIError(500, f"the engine failed this request: {c.error}", "InternalServerError")
    return None

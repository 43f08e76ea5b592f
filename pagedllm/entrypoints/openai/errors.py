"""A request the engine failed mid-generation, as an OpenAI error (vLLM's ``GenerationError``)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.serving_engine import OpenAIError
from pagedllm.outputs import RequestOutput


def generation_error(out: RequestOutput) -> OpenAIError | None:
    """The error of a sample of ``out`` that finished with reason "error", else None.

    A 400 naming the field when the request's own input caused it while generating (its
    constraints leave no token, its grammar fails); otherwise a 500 InternalServerError: the
    request was valid and the engine failed it alone, going on serving the others.
    """
    for c in out.outputs:
        if c.finish_reason == "error" and c.error_param is not None:
            return OpenAIError(400, c.error or "invalid request", param=c.error_param)
        if c.finish_reason == "error":
            return OpenAIError(500, f"the engine failed this request: {c.error}", "InternalServerError")
    return None

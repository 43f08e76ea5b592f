"""A request the engine failed mid-generation, as an OpenAI error (vLLM's ``GenerationError``)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.serving_engine import OpenAIError
from pagedllm.outputs import RequestOutput


def generation_error(out: RequestOutput, constraint_field: str | None = None) -> OpenAIError | None:
    """The error of a sample of ``out`` that finished with reason "error", else None.

    A 400 naming the field when the request's own input caused it while generating (its
    constraints leave no token, its grammar fails); otherwise a 500 InternalServerError: the
    request was valid and the engine failed it alone, going on serving the others.

    Args:
        constraint_field: the request field the output's constraint comes from
            (``guided_regex``, ``response_format.json_schema.schema``, ``tools``, ...); it is
            the ``param`` of an error the engine names ``structured_outputs`` (its own field).
    """
    for c in out.outputs:
        if c.finish_reason == "error" and c.error_param is not None:
            param = constraint_field if c.error_param == "structured_outputs" and constraint_field else c.error_param
            return OpenAIError(400, c.error or "invalid request", param=param)
        if c.finish_reason == "error":
            return OpenAIError(500, f"the engine failed this request: {c.error}", "InternalServerError")
    return None

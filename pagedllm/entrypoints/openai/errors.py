"""OpenAI error bodies: the error every handler raises (``OpenAIError``), an HTTP error's, and a
request the engine failed mid-generation (vLLM's ``GenerationError``)."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.response_bodies import ErrorInfo, ErrorResponse
from pagedllm.outputs import RequestOutput


# The longest message and param an error body carries: both can quote client text (a field's
# name, a model name, a value), which the body must not echo back at any length.
MAX_MESSAGE_CHARS, MAX_PARAM_CHARS = 2000, 200


def _printable(text: str, limit: int) -> str:
    """``text`` at most ``limit`` characters (then a count of the rest), a lone surrogate escaped
    (it would make the body unencodable)."""
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} characters more)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class OpenAIError(Exception):
    """An error answered with OpenAI's body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = _printable(message, MAX_MESSAGE_CHARS)
        self.type = type_
        self.param = None if param is None else _printable(param, MAX_PARAM_CHARS)

    @classmethod
    def bad_request(cls, error: ValueError, fields: Mapping[str, str] = {}) -> OpenAIError:
        """A 400 for invalid input; ``param`` is the field an ``InvalidParamError`` names, or
        the request's own name for it in ``fields`` (engine parameter -> request field, where
        they differ), which then heads the message too."""
        param = getattr(error, "param", None)
        if param in fields:
            return cls(400, f"{fields[param]}: {error}", param=fields[param])
        return cls(400, str(error), param=param)

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()


_ERROR_TYPES = {401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                413: "RequestTooLargeError", 503: "ServiceUnavailableError"}


def error_response(error: OpenAIError) -> JSONResponse:
    """``error``'s JSON body, under its HTTP status."""
    return JSONResponse(error.body(), status_code=error.status)


def http_error(status: int, message: str) -> OpenAIError:
    """An error of the HTTP layer (auth, body size, routing, a dead engine), typed by its status."""
    return OpenAIError(status, message, _ERROR_TYPES.get(status, "BadRequestError"))


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

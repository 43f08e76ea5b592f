"""The FastAPI app of the OpenAI-compatible server: its routes, how errors are answered, and
the middleware (``middleware``) stacked around them.

Run it with ``pagedllm serve`` (``openai.cli_args.run_serve``) or ``python -m
pagedllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
from collections.abc import AsyncIterator, Awaitable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

import pagedllm
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.entrypoints.openai.errors import OpenAIError, error_response, http_error
from pagedllm.entrypoints.openai.middleware import BearerAuthMiddleware, BodySizeLimitMiddleware, CorsPolicy
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    RequestModel,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagedllm.entrypoints.openai.response_bodies import ModelCard, ModelList
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.live_view_routes import live_view_router
from pagedllm.entrypoints.openai.serving_engine import guard_sse
from pagedllm.entrypoints.openai.lora_modules import LoRAModule
from pagedllm.entrypoints.openai.serving_lora import ServingLoRA

logger = logging.getLogger("pagedllm")

# After the engine core dies, keep answering (503 on /health, errors to in-flight requests)
# this long before exiting, so that clients and supervisors see why.
_DEAD_ENGINE_GRACE_S = 1.0


# -- the app --------------------------------------------------------------------------------
async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(request: Request, result: Awaitable[BaseModel | AsyncIterator[str]]) -> Response:
    """Run a handler; a client that hangs up while it runs cancels it (so its requests are aborted)."""
    handler = asyncio.ensure_future(result)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((handler, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        handler.cancel()  # a no-op once it is done; else the client hung up or the server is stopping
    if not handler.done():
        return Response(status_code=499)  # nobody is listening any more
    body = handler.result()
    if isinstance(body, BaseModel):
        return JSONResponse(body.model_dump(mode="json"))
    return StreamingResponse(guard_sse(body), media_type="text/event-stream")


# pydantic's names for the members of a union, which it puts in an error's location: types,
# and request models by class name (``_request_models``).
_UNION_TAG = re.compile(r"str|int|float|bool|none|[\w-]+\[.*\]")


def _request_models(cls: type[RequestModel] = RequestModel) -> set[str]:
    """The class names of ``cls``'s subclasses, at any depth."""
    return {name for sub in cls.__subclasses__() for name in {sub.__name__} | _request_models(sub)}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The message and the field (dotted) of the error to report: the one found deepest in the
    body, which for a union is the member the value was meant for (the parts of a ``content``
    list, not "should be a valid string"; a tool choice object's ``function``, not "should be
    'none', 'auto' or 'required'")."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = max(errors, key=lambda e: len(e.get("loc", ())))  # the earliest of the deepest
    kind = first.get("type")
    if kind == "json_invalid":  # loc: ("body", the character offset of the fault)
        where = [p for p in first.get("loc", ()) if isinstance(p, int)]
        at = f" (at character {where[0]})" if where else ""
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}{at}", None
    tags = _request_models()
    loc = [str(p) for p in first.get("loc", ())
           if p != "body" and not _UNION_TAG.fullmatch(str(p)) and str(p) not in tags]
    param = ".".join(loc) or None
    if param is None and kind == "missing":  # no body at all
        return "the request body is missing: it must be a JSON object (Content-Type: application/json)", None
    if param is None and kind == "model_attributes_type":  # not a JSON object: an array, text/plain
        return "the request body must be a JSON object (Content-Type: application/json)", None
    if kind == "extra_forbidden":
        return f"unsupported field `{param}`: pagedllm does not implement it (see the README's field list)", param
    if kind == "finite_number":
        return f"{param}: NaN and Infinity are not valid values", param
    return (f"{param}: {first.get('msg')}" if param else str(first.get("msg"))), param


def _body_fault(cause: BaseException | None) -> str | None:
    """What is wrong with a body that FastAPI could not parse and answered only "There was an
    error parsing the body" for (the error it raised from), else None."""
    if isinstance(cause, UnicodeDecodeError):
        # json.loads guesses UTF-16 or UTF-32 from a body's first bytes (a byte order mark, or
        # a NUL byte among the first two) and reports its offsets in that encoding: name the
        # first byte that is not UTF-8 instead, or the NUL byte where the body is UTF-8.
        body = bytes(cause.object)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"the request body is not UTF-8: byte {body[e.start]:#04x} at offset {e.start}"
        return ("the request body is not JSON: a NUL byte among its first bytes, which JSON readers take for "
                "UTF-16 or UTF-32")
    if isinstance(cause, RecursionError):
        return "the request body nests JSON arrays or objects too deeply"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "the request body holds an integer of more digits than JSON numbers here may have (4300)"
    return None


def build_app(
    engine: AsyncLLM,
    served_model_names: tuple[str, ...],
    api_key: str | None = None,
    max_request_body_bytes: int = 16 * 1024**2,
    tool_call_parser: str = "hermes",
    chat_template: str | None = None,
    lora_modules: list[LoRAModule] = (),
    cors: CorsPolicy = CorsPolicy(),
) -> FastAPI:
    """The FastAPI app over a started-or-not engine (the app's lifespan starts and stops it),
    serving the base model under ``served_model_names`` (``OpenAIServing``'s);
    ``tool_call_parser`` names the format of "auto" tool calls (``tool_parsers.TOOL_PARSERS``),
    ``chat_template`` a Jinja template's text to use instead of the model's, ``lora_modules``
    the LoRA adapters served from the start (``--enable-lora``),
    ``cors`` the other origins' pages a browser lets call it. CORS is the outermost layer: a
    preflight is answered before the API key is asked for (a browser sends none with it), and
    a 401 or 413 carries the CORS headers, so that the page sees it.

    Raises:
        ValueError: a LoRA module that cannot be served (LoRA off, a bad adapter, a name twice).
    """
    loras = ServingLoRA(engine, served_model_names)
    for module in lora_modules:
        try:
            loras.load(module)
        except OpenAIError as e:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {e.message}") from None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="pagedllm", version=pagedllm.__version__, lifespan=lifespan)
    completion = OpenAIServingCompletion(engine, served_model_names, loras)
    chat = OpenAIServingChat(engine, served_model_names, TOOL_PARSERS[tool_call_parser], chat_template, loras)
    if completion.default_sampling:
        logger.info("the model's generation_config.json sets the defaults of unset request fields (as vLLM's "
                    "--generation-config auto): %s", completion.default_sampling)
    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, completion.create(body))

    @v1.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, chat.create(body))

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        cards = [ModelCard(id=name, root=engine.config.model, max_model_len=engine.max_model_len)
                 for name in served_model_names]
        adapters = [
            ModelCard(id=lora.name, root=lora.path, parent=loras.parent(lora.name), max_model_len=engine.max_model_len)
            for lora in loras.adapters.values()
        ]
        return ModelList(data=[*cards, *adapters]).model_dump(mode="json")

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> dict[str, str]:
        await loras.load_async(body.lora_name, body.lora_path)
        return {"status": "success", "message": f"LoRA adapter {body.lora_name!r} loaded"}

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> dict[str, str]:
        loras.unload(body.lora_name)
        return {"status": "success", "message": f"LoRA adapter {body.lora_name!r} unloaded"}

    app.include_router(v1)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health() -> Response:
        # As vLLM: 503 once any engine core is dead, so that a supervisor replaces the server (a
        # dead core is not restarted); with data parallelism the other cores serve meanwhile.
        if engine.is_healthy:
            return Response(status_code=200)
        return error_response(http_error(503, engine.health_error()))

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # vLLM's (SageMaker's probe): /health's answer
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedllm.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def tokenize_sync(body: TokenizeRequest) -> JSONResponse:
        chat.check_request(body)
        if body.messages is not None and body.prompt is not None:
            raise OpenAIError(400, "give either prompt or messages, not both", param="messages")
        if body.messages is not None:
            tokens = chat.render(body.messages, body.add_generation_prompt, body.tools)
        elif body.prompt is not None:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise OpenAIError(400, "give either prompt or messages", param="prompt")
        result: dict[str, Any] = {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
        if body.return_token_strs:
            result["token_strs"] = engine.tokenizer.convert_ids_to_tokens(tokens)
        return JSONResponse(result)

    def detokenize_sync(body: DetokenizeRequest) -> JSONResponse:
        chat.check_request(body)
        vocab = engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens)})

    # Checks, chat template, (de)tokenizing and the JSON of the answer (millions of ids for a
    # large body) in a worker thread, as the /v1 routes prepare requests: a large body never
    # holds the event loop that serves every other client.
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await asyncio.to_thread(tokenize_sync, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await asyncio.to_thread(detokenize_sync, body)

    app.include_router(live_view_router(engine.live_view))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        return {"success": await engine.reset_prefix_cache()}

    @app.exception_handler(OpenAIError)
    async def on_openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400, not FastAPI's 422, for a body it cannot accept.
        message, param = _validation_message(exc)
        return error_response(OpenAIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(http_error(exc.status_code, _body_fault(exc.__cause__) or str(exc.detail)))

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(http_error(503, str(exc)))

    @app.exception_handler(Exception)
    async def on_internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error", exc_info=exc)
        return error_response(OpenAIError(500, f"internal error: {type(exc).__name__}", "InternalServerError"))

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)
    if cors.origins:  # added last: the outermost
        app.add_middleware(CORSMiddleware, allow_origins=cors.origins, allow_methods=cors.methods,
                           allow_headers=cors.headers, allow_credentials=cors.credentials)
    return app


class ApiServer(uvicorn.Server):
    """uvicorn's server, except that SIGINT/SIGTERM first abort the engine's in-flight requests
    (graceful shutdown would otherwise wait for every stream to finish), and the exit status
    after such a shutdown is 0.

    Args:
        config: uvicorn settings.
        engine: the engine whose requests are aborted on shutdown.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM) -> None:
        super().__init__(config)
        self.engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler may interrupt the loop anywhere: hand the abort to the loop itself.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.engine.abort_all)
        # uvicorn also records the signal to re-raise it after shutdown; stopping is the
        # expected outcome here, so it is not recorded and the exit status stays 0.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    def exit_soon(self) -> None:
        """Shut down shortly (after the engine core has died)."""
        asyncio.get_running_loop().call_later(_DEAD_ENGINE_GRACE_S, setattr, self, "should_exit", True)


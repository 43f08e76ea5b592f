"""``pagedllm serve``: its flags (beside the engine flags) and the function that runs the server."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from typing import TYPE_CHECKING

from pagedllm.engine.arg_utils import parse_float, parse_int
from pagedllm.entrypoints.chat_template import add_chat_template_arg, load_chat_template
from pagedllm.entrypoints.openai.lora_modules import parse_lora_module
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.scheduler_defaults import SERVE_MAX_NUM_BATCHED_TOKENS

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm")

# Backstop for graceful shutdown: in-flight streams are aborted first, so this is rarely reached.
_GRACEFUL_SHUTDOWN_TIMEOUT_S = 10


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    value = parse_int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def api_key(text: str) -> str:
    """argparse type: a non-empty key (an empty one would silently turn authentication off)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (omit --api-key to serve without one)")
    return text


def model_name(text: str) -> str:
    """argparse type: a non-empty name (an empty one would silently serve the model argument's)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (omit --served-model-name to serve the model argument's)")
    return text


def json_str_list(text: str) -> tuple[str, ...]:
    """argparse type: a JSON list of strings, as vLLM's ``--allowed-origins '["*"]'``."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, such as '[\"*\"]', got {text}")
    return tuple(value)


def positive_seconds(text: str) -> float:
    """argparse type: a finite duration in seconds, above 0."""
    value = parse_float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value


def served_model_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The names the ``model`` field selects the base model by (``--served-model-name``, else the
    model as given)."""
    return tuple(args.served_model_name or [args.model])


def check_serve_args(args: argparse.Namespace) -> None:
    """The server flags that argparse types cannot check, before any model is loaded.

    Raises:
        ValueError: for a bad value.
    """
    from pagedllm.config_values import parse_memory

    try:
        parse_memory(args.max_request_body_size)
    except ValueError as e:
        raise ValueError(f"--max-request-body-size: {e}") from None
    grammar_limits(args)
    names = served_model_names(args)
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"--served-model-name: {twice!r} is given twice")
    taken = set(names)
    for item in args.lora_modules:
        name = parse_lora_module(item).name
        if name in taken:
            raise ValueError(f"--lora-modules {item}: the model name {name!r} is already in use")
        taken.add(name)
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.grammar_workers < 1:
        raise ValueError(f"--grammar-workers must be at least 1, got {args.grammar_workers}")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags; the engine flags (model, dtype, KV cache, ...) are added by the caller."""
    from pagedllm.engine.arg_utils import positive_int

    parser.set_defaults(max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)  # first tokens sooner under load
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0: every interface")
    parser.add_argument("--port", type=port_number, default=8000, help="TCP port; 0: any free one")
    parser.add_argument("--served-model-name", type=model_name, nargs="+", default=None, metavar="NAME",
                        help="model names in the API, any of which the `model` field may give; responses to a "
                        "request that gives none name the first (default: the model argument)")
    parser.add_argument("--api-key", type=api_key, default=None,
                        help="require `Authorization: Bearer KEY` on every route but /health, /ping, /metrics, /version")
    parser.add_argument("--max-request-body-size", default="16MiB", help="larger request bodies get 413")
    # vLLM's CORS flags; middleware.CorsPolicy says why no origin is the default.
    parser.add_argument("--allowed-origins", type=json_str_list, default="[]", metavar="JSON",
                        help='origins whose pages a browser lets call the server (CORS), a JSON list: \'["*"]\' '
                        "for any, [] for none (no CORS headers)")
    parser.add_argument("--allowed-methods", type=json_str_list, default='["*"]', metavar="JSON",
                        help="HTTP methods allowed to those origins, a JSON list")
    parser.add_argument("--allowed-headers", type=json_str_list, default='["*"]', metavar="JSON",
                        help="request headers allowed to those origins, a JSON list")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="let those origins' pages send cookies and HTTP authentication")
    # vLLM has no flags for these (its keep-alive is the VLLM_HTTP_TIMEOUT_KEEP_ALIVE variable): uvicorn's names.
    parser.add_argument("--timeout-keep-alive", type=positive_seconds, default=5.0,
                        help="close a connection that sends nothing this many seconds after connecting or after a response")
    parser.add_argument("--timeout-request-head", type=positive_seconds, default=10.0,
                        help="close a connection whose next request head (request line and headers) is not complete "
                        "this many seconds after connecting or after a response")
    parser.add_argument("--limit-concurrency", type=positive_int, default=512,
                        help="most connections open at once (live-view viewers and idle keep-alive connections count): "
                        "a request that arrives while more are open is answered 503 at once")
    parser.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log line")
    parser.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    parser.add_argument("--enable-live-view", action="store_true",
                        help="record every engine step; serve the live view at /dashboard and a trace at /debug/trace")
    parser.add_argument("--live-view-steps", type=int, default=4096, help="engine steps the live view keeps")
    parser.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                        help="engine-core processes, each a full replica with its own KV cache and its share of "
                        "the cores; requests go to the least-loaded one, or to the one holding their prefix")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH|JSON",
                        help="LoRA adapters (PEFT folders or llama.cpp GGUF files) served from the start, each "
                        "selected by its NAME in the `model` field (needs --enable-lora); or vLLM's JSON form "
                        '\'{"name": NAME, "path": PATH, "base_model_name": PARENT}\', PARENT (optional) the '
                        "`parent` /v1/models gives it")
    add_chat_template_arg(parser)
    parser.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                        help='format of the tool calls a model writes, read for tool_choice "auto", where the chat '
                        "template has a tool section; under a template without one, tools use pagedllm's generic "
                        "format (a system message, JSON calls) whatever this says")
    add_grammar_args(parser)


_GRAMMAR_HELP = {
    "max_bytes": "bytes of one schema, regex, grammar or choice list",
    "max_rules": "rules of a grammar, subschemas of a schema",
    "max_depth": "deepest rule chain, $ref chain or nesting",
    "max_alternatives": "alternatives of one rule; anyOf/oneOf/enum entries",
    "max_choices": "entries of a choice list",
    "max_properties": "properties of one object schema",
    "compile_timeout_s": "seconds one constraint may take to compile (isolated check)",
}


def _grammar_flag(field: str) -> str:
    return "--grammar-compile-timeout" if field == "compile_timeout_s" else "--max-grammar-" + field[4:]


def add_grammar_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``GrammarLimits`` field, plus the number of grammar worker processes."""
    from pagedllm.structured_output.checker import DEFAULT_WORKERS
    from pagedllm.structured_output.limits import GrammarLimits

    group = parser.add_argument_group("structured outputs (a constraint beyond a limit gets a 400 naming its field)")
    for field in GrammarLimits.__struct_fields__:
        default = getattr(GrammarLimits(), field)
        group.add_argument(_grammar_flag(field), dest=f"grammar_{field}", type=type(default), default=default,
                           metavar="SECONDS" if field == "compile_timeout_s" else "N",
                           help=_GRAMMAR_HELP[field])
    group.add_argument("--grammar-workers", type=int, default=DEFAULT_WORKERS,
                       help="processes that compile-check constraints in isolation")


def grammar_limits(args: argparse.Namespace):
    """The ``GrammarLimits`` of the ``--max-grammar-*`` flags.

    Raises:
        ValueError: a limit that is not positive, naming its flag.
    """
    from pagedllm.structured_output.limits import GrammarLimits

    values = {f: getattr(args, f"grammar_{f}") for f in GrammarLimits.__struct_fields__}
    for field, value in values.items():
        if not value > 0:  # NaN too
            raise ValueError(f"{_grammar_flag(field)} must be positive, got {value}")
    return GrammarLimits(**values)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the engine flags, read the way every other command reads them.

    Raises:
        ValueError: for a bad value, a combination data parallelism refuses (the live view), or
            a tensor-parallel size the model cannot split (read from its config, not loaded).
    """
    from pagedllm.config import EngineConfig
    from pagedllm.config_values import parse_memory
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.platforms.cpu import dtype_settings, lora_dtype_setting

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.check()
    kwargs = engine_args.kwargs()
    kwargs["lora_dtype"] = lora_dtype_setting(kwargs["dtype"], kwargs["lora_dtype"])
    kwargs |= dtype_settings(kwargs.pop("dtype"), kwargs.pop("kv_cache_dtype"), kwargs.pop("quantization"))
    kwargs["kv_cache_memory"] = parse_memory(kwargs["kv_cache_memory"])  # checked by check()
    config = EngineConfig(  # getattr: serve's flags, which other commands lack
        **kwargs, live_view=getattr(args, "enable_live_view", False),
        live_view_steps=getattr(args, "live_view_steps", 4096), data_parallel_size=getattr(args, "data_parallel_size", 1),
    )
    if config.data_parallel_size > 1:
        from pagedllm.engine.dp_client import check_data_parallel

        check_data_parallel(config)
    if config.tensor_parallel_size > 1:
        from pagedllm.distributed.sharding import check_tensor_parallel_size
        from pagedllm.models.loader import load_config, resolve_model

        check_tensor_parallel_size(load_config(resolve_model(config.model)), config.tensor_parallel_size,
                                   config.quantization_config() is not None)
    return config


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening) before the model loads, as vLLM binds its
    port first: a port in use or a host that is not an address of this machine is named at once
    instead of after the load. uvicorn listens on it once the app is up.

    Raises:
        ValueError: the address cannot be bound, naming --host and --port.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host!r} --port {port}: cannot bind the address: {e.strerror or e}") from None
    return sock


def run_serve(args: argparse.Namespace) -> None:
    """Start the engine core(s), serve until SIGINT/SIGTERM; exit with status 1 once every core has died.

    Raises:
        ValueError: for a bad flag value, an address that cannot be bound (before loading) or an
            unknown model.
    """
    import uvicorn

    from pagedllm.config_values import parse_memory
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.app import ApiServer, build_app
    from pagedllm.entrypoints.openai.connections import http_protocol
    from pagedllm.entrypoints.openai.middleware import CorsPolicy

    from pagedllm.structured_output import checker

    checker.configure(grammar_limits(args), args.grammar_workers)
    config = engine_config(args)
    max_body = parse_memory(args.max_request_body_size)
    names = served_model_names(args)
    with listening_socket(args.host, args.port) as sock:  # bound before the engine loads
        try:
            engine = AsyncLLM(config, names[0], log_stats=not args.disable_log_stats)
        except RuntimeError as e:
            logger.error("%s", e)
            sys.exit(1)
        try:
            app = build_app(engine, names, args.api_key, max_body, args.tool_call_parser,
                            load_chat_template(args.chat_template), [parse_lora_module(m) for m in args.lora_modules],
                            CorsPolicy(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                                       args.allow_credentials))
            server = ApiServer(
                uvicorn.Config(
                    app, host=args.host, port=args.port, access_log=not args.disable_access_log,
                    timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_TIMEOUT_S, http=http_protocol(args.timeout_request_head),
                    timeout_keep_alive=args.timeout_keep_alive,  # type: ignore[arg-type]  # uvicorn takes a float here too
                    # uvicorn answers 503 once the open connections, this one included, reach its limit.
                    limit_concurrency=args.limit_concurrency + 1,
                ),
                engine,
            )
            engine.on_dead(server.exit_soon)  # the last core: with data parallelism the others serve on
            logger.info(
                "serving %s as %s on http://%s:%d; max_model_len %d; KV cache: %d blocks x %d tokens = %d tokens%s",
                config.model, ", ".join(map(repr, names)), f"[{args.host}]" if ":" in args.host else args.host,
                sock.getsockname()[1], engine.max_model_len,
                engine.num_blocks, engine.block_size, engine.num_blocks * engine.block_size,
                f" per engine core, {engine.num_engines} cores (pids {engine.client.pids})" if engine.num_engines > 1 else "",
            )
            server.run(sockets=[sock])
        finally:
            engine.shutdown()
    if engine.dead_error is not None:
        logger.error("exiting because the engine core died: %s", engine.dead_error)
        sys.exit(1)


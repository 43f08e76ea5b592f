"""The ``pagedllm`` command: generate, chat, serve, bench, env.

Every flag is checked (engine settings and sampling values) before a model is loaded: a bad
value is a usage error, exit status 2, within a second or two.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from pagedllm import __version__
from pagedllm.engine.arg_utils import EngineArgs, finite_float, positive_int
from pagedllm.errors import InvalidParamError


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose ``--help`` shows every flag's default, subcommands included
    (subparsers are made with the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        # The formatter annotates only flags that have a help text.
        if kwargs.get("help") is None and kwargs.get("action") not in ("help", "version"):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling flags (SamplingParams' names); values are range-checked before any model loads."""
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="most tokens to generate")
    parser.add_argument("--temperature", type=finite_float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1: off")
    parser.add_argument("--min-p", type=finite_float, default=0.0, help="drop tokens below min_p x the top probability")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--presence-penalty", type=finite_float, default=0.0, help="in [-2, 2]")
    parser.add_argument("--frequency-penalty", type=finite_float, default=0.0, help="in [-2, 2]")
    parser.add_argument("--repetition-penalty", type=finite_float, default=1.0, help="in (0, 2]; 1 is off")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def json_schema_arg(value: str) -> dict[str, Any]:
    """A JSON schema given as a file path or as JSON text.

    Raises:
        ValueError: neither a readable file nor JSON text, or not a JSON object.
    """
    from pathlib import Path

    path = Path(value)
    text = path.read_text() if not value.lstrip().startswith("{") and path.is_file() else value
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--json-schema: {value!r:.80} is neither a file nor JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema must be a JSON object, got {type(schema).__name__}")
    return schema


def sampling_params(args: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.structured_output import StructuredOutputsParams, backend

    structured = None
    if getattr(args, "json_schema", None) is not None:
        structured = StructuredOutputsParams(json=json_schema_arg(args.json_schema))
        backend.check(structured)  # a schema that cannot compile is a usage error, before loading
    return SamplingParams(
        structured_outputs=structured,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from pagedllm import LLM

    llm = LLM(**EngineArgs.from_cli_args(args).kwargs())
    params = sampling_params(args)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for out in outputs:
        for c in out.outputs:
            if args.json:
                record = {"prompt": out.prompt, "text": c.text, "finish_reason": c.finish_reason}
                print(json.dumps(record | ({"error": c.error} if c.error else {})))
            else:
                reason = f"{c.finish_reason}: {c.error}" if c.error else c.finish_reason
                print(f"--- prompt: {out.prompt!r}\n{c.text}\n--- finish_reason: {reason}")


def cmd_chat(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.chat_repl import run_repl

    run_repl(args)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pagedllm", description="LLM inference and serving with a paged KV cache")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    EngineArgs.add_cli_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    gen.add_argument(
        "--json-schema", default=None, help="constrain each output to this JSON schema: a file path or JSON text"
    )
    gen.set_defaults(func=cmd_generate, command_parser=gen)

    chat = sub.add_parser("chat", help="interactive chat that streams tokens")
    EngineArgs.add_cli_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("-v", "--verbose", action="store_true", help="log at INFO (else warnings only)")
    chat.set_defaults(func=cmd_chat, temperature=0.7, max_tokens=512, command_parser=chat)

    from pagedllm.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from pagedllm.entrypoints.env import add_env_parser

    add_env_parser(sub)

    from pagedllm.entrypoints.openai.cli_args import add_serve_args, run_serve

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(serve, positional_model=True)
    add_serve_args(serve)
    serve.set_defaults(func=run_serve, command_parser=serve)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Build the engine config and sampling params the command will use, without loading anything.

    Raises:
        ValueError: for a value out of its range (the message names the flag's setting).
    """
    if hasattr(args, "kv_cache_dtype"):  # a command with the engine flags (EngineArgs)
        from pagedllm.entrypoints.openai.cli_args import engine_config

        engine_config(args)
    if hasattr(args, "temperature"):
        sampling_params(args)
    if hasattr(args, "max_request_body_size"):
        from pagedllm.entrypoints.openai.cli_args import check_serve_args

        check_serve_args(args)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Before anything slow: checking the flags picks the native kernels, which the first run
    # on a machine compiles for minutes, and says so.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_args(args)
    except ValueError as e:  # exit 2, before a model is loaded, with the command's usage and flag
        flag = f"argument --{e.param.replace('_', '-')}: " if isinstance(e, InvalidParamError) else ""
        getattr(args, "command_parser", parser).error(flag + str(e))
    if args.command == "chat" and not args.verbose:  # the REPL streams: log lines would cut into replies
        logging.getLogger().setLevel(logging.WARNING)
    try:
        args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)  # Ctrl-C while loading: no traceback


if __name__ == "__main__":
    main()

"""The ``pagedllm`` command: generate, chat, serve, bench, env.

Every flag is checked (engine settings and sampling values) before a model is loaded: a bad
value is a usage error, exit status 2, naming the flag as typed, under the command's short
usage line. Only the command given is built, and its heavy modules (torch, transformers) are
imported only once its flags have parsed: ``--help`` and ``--version`` import neither, and a
command logs its first line before they load.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import logging
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pagedllm import __version__
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.sampling_args import add_sampling_args, sampling_params
from pagedllm.entrypoints.vllm_only import hint

logger = logging.getLogger("pagedllm")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default once: a help text that states its default in words
    ("... (default: the model argument)") is left as it is. A list default is shown as the
    flag takes it, comma separated (``1,8``, not ``[1, 8]``); an empty list or text as "none"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)

    def _expand_help(self, action: argparse.Action) -> str:
        if isinstance(action.default, (list, tuple, str)):
            action = copy.copy(action)
            shown = action.default if isinstance(action.default, str) else ",".join(map(str, action.default))
            action.default = shown or "none"
        return super()._expand_help(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose ``--help`` shows every flag's default, subcommands included
    (subparsers are made with the parent's class); flags only as written in full (as vLLM's:
    ``--max-tok`` is no ``--max-tokens``, so a flag added later never changes an old command)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        # The formatter annotates only flags that have a help text.
        if kwargs.get("help") is None and kwargs.get("action") not in ("help", "version"):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        """Exit 2 with the usage line, the message (with a hint where argparse's own misleads:
        a value that looks like a flag, a mistyped command) and where the flags are listed."""
        if message.startswith("argument --") and message.endswith(": expected one argument"):
            flag = message.removeprefix("argument ").split(":")[0].split("/")[0]
            message += f" (a value that starts with '-' is written {flag}=-VALUE)"
        elif (choice := re.match(r"argument \w+: invalid choice: '([^']*)' \(choose from (.*)\)$", message)) is not None:
            near = difflib.get_close_matches(choice[1], re.findall(r"'([^']*)'", choice[2]), 1, 0.6)
            message += f"; did you mean {near[0]}?" if near else ""
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists every flag)\n")


def cmd_generate(args: argparse.Namespace) -> None:
    from pagedllm import LLM
    from pagedllm.entrypoints.chat_template import has_chat_template, load_chat_template

    llm = LLM(**EngineArgs.from_cli_args(args).kwargs())
    params = sampling_params(args)
    if args.chat:
        template = load_chat_template(args.chat_template)
        if not has_chat_template(llm.engine.tokenizer, template):
            raise ValueError(f"{args.model} has no chat template: give one with --chat-template FILE|TEMPLATE, "
                             "or leave out --chat")
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params, chat_template=template)
    else:
        outputs = llm.generate(args.prompt, params)
    for out in outputs:
        for c in out.outputs:
            if args.json:
                record = {"prompt": out.prompt, "text": c.text, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}  # the --stop string (or token id) that ended it
                print(json.dumps(record | ({"error": c.error} if c.error else {})))
            else:
                reason = f"{c.finish_reason}: {c.error}" if c.error else c.finish_reason
                print(f"--- prompt: {out.prompt!r}\n{c.text}\n--- finish_reason: {reason}")


def cmd_chat(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.chat_repl import run_repl

    run_repl(args)


def _add_generate(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> None:
    from pagedllm.entrypoints.chat_template import add_chat_template_arg

    EngineArgs.add_cli_args(parser)
    add_sampling_args(parser)
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_chat_template_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object per output: prompt, text, finish_reason, stop_reason")
    parser.add_argument(
        "--json-schema", default=None, help="constrain each output to this JSON schema: a file path or JSON text"
    )
    parser.set_defaults(func=cmd_generate)


def _add_chat(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> None:
    from pagedllm.entrypoints.chat_template import add_chat_template_arg

    EngineArgs.add_cli_args(parser)
    add_sampling_args(parser)
    parser.add_argument("--system", default=None, help="system prompt")
    add_chat_template_arg(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO (else warnings only)")
    parser.set_defaults(func=cmd_chat, temperature=0.7, max_tokens=512)


def _add_serve(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> None:
    from pagedllm.entrypoints.openai.cli_args import add_serve_args, run_serve

    EngineArgs.add_cli_args(parser, serve=True)
    add_serve_args(parser)
    parser.set_defaults(func=run_serve)


def _add_bench(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> None:
    from pagedllm.bench.cli import add_bench_commands

    # "": --help of bench itself, which lists the benchmarks without building any.
    add_bench_commands(parser, None if argv is None else _command(argv[argv.index("bench") + 1 :]) or "")


def _add_env(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> None:
    from pagedllm.entrypoints.env import add_env_args

    add_env_args(parser)


# name, help, short usage (None: argparse's), what adds the flags.
_COMMANDS: tuple[tuple[str, str, str | None, Callable[[argparse.ArgumentParser, Sequence[str] | None], None]], ...] = (
    ("generate", "generate text for one or more prompts", "%(prog)s --prompt TEXT [--prompt TEXT ...] [options]",
     _add_generate),
    ("chat", "interactive chat that streams tokens", "%(prog)s [options]", _add_chat),
    ("bench", "benchmarks", None, _add_bench),
    ("env", "print the machine, install and kernel facts a bug report needs", None, _add_env),
    ("serve", "OpenAI-compatible HTTP server", "%(prog)s [model] [options]", _add_serve),
)


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not a flag (the parsers above a
    subcommand have no flag that takes a value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``pagedllm`` parser. Every command gets its flags, or with ``argv`` only the one it
    names (none for ``--help`` or ``--version``): the others' modules are not imported."""
    parser = Parser(prog="pagedllm", description="LLM inference and serving with a paged KV cache")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = None if argv is None else _command(argv)
    for name, help_text, usage, add in _COMMANDS:
        command = sub.add_parser(name, help=help_text, usage=usage, description=help_text)
        if argv is None or name == chosen:
            add(command, argv)
            command.set_defaults(command_parser=command)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Build the engine config and sampling params the command will use, without loading anything.

    Raises:
        ValueError: for a value out of its range (the message names the flag's setting), or
            an empty ``--prompt`` without ``--chat`` (no token to continue from; the chat
            template gives an empty message some).
    """
    if getattr(args, "prompt", None) and not args.chat and "" in args.prompt:
        raise ValueError("prompt must not be empty (an empty message is taken with --chat)")
    if hasattr(args, "kv_cache_dtype"):  # a command with the engine flags: those torch need not check, first
        from pagedllm.engine.arg_utils import EngineArgs

        EngineArgs.from_cli_args(args).check()
    if hasattr(args, "sampling_seed"):  # the commands with add_sampling_args' flags
        sampling_params(args)
    if hasattr(args, "chat_template"):
        from pagedllm.entrypoints.chat_template import load_chat_template

        load_chat_template(args.chat_template)
    if hasattr(args, "max_request_body_size"):
        from pagedllm.entrypoints.openai.cli_args import check_serve_args

        check_serve_args(args)
    if hasattr(args, "kv_cache_dtype"):  # a command with the engine flags (EngineArgs); last, as it imports torch
        from pagedllm.entrypoints.openai.cli_args import engine_config

        engine_config(args)


def _flag_message(error: ValueError, parser: argparse.ArgumentParser) -> str:
    """A flag check's error naming the flag, as typed: a message that opens with a setting's
    name (``top_p must be ...``) opens with its flag (``--top-p must be ...``), and one that
    names the setting only as ``param`` is prefixed with the flag."""
    flags = {a.dest: max(a.option_strings, key=len) for a in parser._actions if a.option_strings}
    text = str(error)
    word = text.split(" ", 1)[0]
    if word in flags:
        return flags[word] + text[len(word):]
    param = getattr(error, "param", None)
    return f"{flags[param]}: {text}" if param in flags else text


def _out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed: Python's MemoryError, or torch's
    RuntimeError for a tensor larger than memory or than its size arithmetic."""
    text = str(error)
    words = ("not enough memory", "can't allocate memory", "Storage size calculation overflowed")
    return isinstance(error, MemoryError) or any(w in text for w in words)


def _unknown_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The (sub)command's parser ``argv`` names (its leading words that name subcommands) and
    the ``--`` flags in ``argv`` it does not take."""
    flags_seen = False
    unknown = []
    for word in argv:
        if word.startswith("--"):
            flags_seen = True
            if word.split("=", 1)[0] not in parser._option_string_actions:
                unknown.append(word)
        elif not flags_seen and parser._subparsers is not None:
            choices = parser._subparsers._group_actions[0].choices
            if word in choices:
                parser = choices[word]
    return parser, unknown


def _closest(parser: argparse.ArgumentParser, word: str) -> str:
    """"; did you mean --x?" for the flag of ``parser`` nearest a mistyped ``word``, else ""."""
    flag = word.split("=", 1)[0]
    near = difflib.get_close_matches(flag, [f for f in parser._option_string_actions if f.startswith("--")], 1, 0.75)
    return f"; did you mean {near[0]}?" if near else ""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    # Unknown flags first, under the command's usage, whose --help lists its flags (the top
    # level's does not): a mistyped flag (--promt) is named, not reported as a required one
    # missing (--prompt).
    command, unknown = _unknown_flags(parser, argv)
    if not unknown:
        args, unknown = parser.parse_known_args(argv)
        command = getattr(args, "command_parser", parser)
    if unknown:
        hints = "".join(hint(word) or _closest(command, word) for word in unknown if word.startswith("--"))
        command.error(f"unrecognized arguments: {' '.join(unknown)}{hints}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "chat" and not args.verbose:  # the REPL streams: log lines would cut into replies
        logging.getLogger().setLevel(logging.WARNING)
    if hasattr(args, "kv_cache_dtype"):  # a command that builds an engine: say so before the imports
        logger.info("pagedllm %s %s: model %s; checking the flags, then loading", __version__,
                    " ".join(w for w in (args.command, getattr(args, "bench_command", None)) if w), args.model)
    # Before anything slow: checking the flags picks the native kernels, which the first run
    # on a machine compiles for minutes, and says so.
    try:
        check_args(args)
    except ValueError as e:  # exit 2, before a model is loaded, with the command's usage and flag
        args.command_parser.error(_flag_message(e, args.command_parser))
    try:
        args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (MemoryError, RuntimeError) as e:  # sizes past the machine's memory: a line, not a traceback
        if not _out_of_memory(e):
            raise
        print(f"error: what the flags ask for does not fit in this machine's memory ({str(e).splitlines()[0]})",
              file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)  # Ctrl-C while loading: no traceback


if __name__ == "__main__":
    main()

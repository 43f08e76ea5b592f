"""``pagedllm chat``: an interactive chat that streams the reply as it is generated.

Ctrl-C while a reply streams stops it (the request is aborted, its KV blocks freed) and
returns to the prompt; Ctrl-C or Ctrl-D at the prompt, or /exit (/quit), ends the chat with
status 0. Any other line of one word after a slash is a mistyped command: answered with the
commands, not sent to the model.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine

_COMMAND = re.compile(r"/\w+")


def run_repl(args: argparse.Namespace) -> None:
    """Read a user turn, stream the assistant's reply, repeat; /reset clears, /exit or EOF ends."""
    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.chat_template import chat_prompt, has_chat_template, load_chat_template
    from pagedllm.entrypoints.sampling_args import sampling_params

    llm = LLM(**EngineArgs.from_cli_args(args).kwargs())
    engine, params = llm.engine, sampling_params(args)
    template = load_chat_template(args.chat_template)
    if not has_chat_template(engine.tokenizer, template):
        raise ValueError(f"{args.model} has no chat template: give one with --chat-template FILE|TEMPLATE")
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("pagedllm chat: type a message; /reset clears the conversation, /exit, Ctrl-D or Ctrl-C quits; "
          "Ctrl-C during a reply stops it.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)  # end the prompt's line
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            print("[conversation cleared" + (", system prompt kept]" if args.system else "]"), file=sys.stderr)
            continue
        if _COMMAND.fullmatch(line.strip()):  # a mistyped command is not a message to the model
            print(f"[unknown command {line.strip()}: /reset clears the conversation, /exit quits]", file=sys.stderr)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        _, prompt = chat_prompt(engine.tokenizer, history, chat_template=template)  # what the user typed is text, markup and all
        turn += 1
        # A reply takes at most what the context has left (as vLLM's server does without
        # max_tokens): --max-tokens is a cap, not a demand that fails every turn of a short context.
        room = engine.max_model_len - len(prompt)
        turn_params = msgspec.structs.replace(params, max_tokens=room) if 0 < room < params.max_tokens else params
        try:
            engine.add_request(f"chat-{turn}", prompt, turn_params, stream=True)
        except ValueError as e:
            print(f"error: {e}" + (" (/reset clears the conversation)" if room <= 0 else ""), file=sys.stderr)
            history.pop()
            continue
        reply = stream_reply(engine, f"chat-{turn}")
        # An interrupted reply stays in the history: it is what the user saw.
        history.append({"role": "assistant", "content": reply})


def stream_reply(engine: LLMEngine, request_id: str) -> str:
    """Step the engine until the request ends or Ctrl-C arrives, printing its text as it comes.

    Ctrl-C only raises a flag, checked between steps: interrupting a step halfway could leave
    the scheduler's state torn. On Ctrl-C the request is aborted, which frees its blocks.

    Returns:
        The reply's text so far.
    """
    interrupted = False

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        interrupted = True

    reply: list[str] = []
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        while engine.has_unfinished_requests() and not interrupted:
            for out in engine.step():
                c = out.outputs[0]
                reply.append(c.text)
                print(c.text, end="", flush=True)
                if c.finish_reason == "error":
                    print(f"\n[error: {c.error}]", end="", file=sys.stderr, flush=True)
        if interrupted:
            engine.abort_request(request_id)
            print("\n[interrupted]", end="", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    print()
    return "".join(reply)


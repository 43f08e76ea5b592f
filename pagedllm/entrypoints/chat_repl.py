"""``pagedllm chat``: an interactive chat that streams the reply as it is generated."""

from __future__ import annotations

import argparse
import sys


def run_repl(args: argparse.Namespace) -> None:
    """Read a user turn, stream the assistant's reply, repeat; /reset clears, /exit or EOF ends."""
    from pagedllm import LLM
    from pagedllm.entrypoints.cli import engine_kwargs, sampling_params

    llm = LLM(**engine_kwargs(args))
    engine, params = llm.engine, sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("pagedllm chat: type a message; /reset clears the conversation, /exit quits.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        turn += 1
        try:
            engine.add_request(f"chat-{turn}", prompt, params, stream=True)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        reply = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                delta = out.outputs[0].text
                reply.append(delta)
                print(delta, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})

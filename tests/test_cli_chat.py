"""The chat REPL: replies within a short context, /reset, and Ctrl-C / Ctrl-D (under tmux, a real terminal)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import pytest

from pagedllm import LLM
from pagedllm.entrypoints.chat_repl import stream_reply
from pagedllm.entrypoints.cli import main
from tests.server_util import CLI_SMALL as SMALL
from tests.server_util import ROOT
from tests.utils import pool_is_whole


def test_chat_replies_within_a_short_context(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`chat --max-model-len 128` refused every turn (prompt + the default --max-tokens 512 >
    128): a reply now takes what the context has left, and a conversation grown past the
    context is refused naming /reset. A mistyped command is answered, not sent; /quit quits."""
    lines = iter(["Tell me a long story about a dragon.", "Go on, in detail. " * 30, "/reset", "/rest", "Hi!",
                  "/quit", "not read"])

    def fake_input(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    main(["chat", "--max-model-len", "128", "--kv-cache-memory", "64MiB", "--dtype", "float32", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert err.count("error: ") == 1, err  # the second turn only, longer than the context with the first
    assert "longer than this model's maximum context length of 128 tokens (/reset clears the conversation)" in err
    assert "[conversation cleared]" in err and len(out.strip().splitlines()) >= 2  # the first reply, then "Hi!"'s
    assert "[unknown command /rest: /reset clears the conversation, /exit quits]" in err
    assert next(lines) == "not read"


def test_stream_reply_interrupted_aborts_and_frees_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C (SIGINT) while a reply streams: the loop ends after the current step, the request is
    aborted, and the process's own SIGINT handler is back (SIG_IGN in a background job)."""
    before = signal.getsignal(signal.SIGINT)
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=1024)
    engine = llm.engine
    step: Callable[[], list] = engine.step
    steps = 0

    def step_then_interrupt() -> list:
        nonlocal steps
        steps += 1
        if steps == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return step()

    engine.step = step_then_interrupt  # type: ignore[method-assign]
    from pagedllm import SamplingParams

    engine.add_request("r", "Tell me a long story.", SamplingParams(max_tokens=200, ignore_eos=True), stream=True)
    reply = stream_reply(engine, "r")
    assert reply and steps == 3
    assert not engine.has_unfinished_requests()
    assert pool_is_whole(llm)
    assert "[interrupted]" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before  # restored


# -- the REPL in a terminal ------------------------------------------------------------------
class Tmux:
    """One detached tmux session running a command; its screen read by polling capture-pane.

    The session runs on a tmux server of its own (its own socket, no configuration file), started
    by this process: the command gets this process's environment, not that of a tmux server the
    user may already run.
    """

    def __init__(self, command: str) -> None:
        self.name = f"pagedllm-test-{uuid.uuid4().hex[:8]}"
        # The shell stays after the command so its exit status can be read from the screen.
        shell = f"{command}; echo EXIT=$?; sleep 600"
        self._tmux("new-session", "-d", "-s", self.name, "-x", "200", "-y", "50", shell)

    def _tmux(self, *args: str, check: bool = True) -> str:
        return subprocess.run(["tmux", "-L", self.name, "-f", os.devnull, *args],
                              capture_output=True, text=True, check=check).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", self.name, "-S", "-1000")

    def send(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", self.name, *keys)

    def wait_for(self, predicate: Callable[[str], bool], what: str, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            if "EXIT=" in screen and "EXIT=" not in what:
                break
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}; screen:\n{self.screen()}")

    def close(self) -> None:
        self._tmux("kill-server", check=False)


def _prompts(screen: str) -> int:
    return sum(line.startswith("> ") or line == ">" for line in screen.splitlines())


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)")
@pytest.mark.parametrize("exit_key", ["C-d", "C-c"])
def test_chat_ctrl_c_stops_reply_then_exits_0(exit_key: str) -> None:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "chat", *SMALL, "--temperature", "0",
           "--max-tokens", "600", "--ignore-eos"]
    tmux = Tmux(f"cd {shlex.quote(str(ROOT))} && {shlex.join(cmd)}")
    try:
        tmux.wait_for(lambda s: _prompts(s) == 1, "the first prompt")
        tmux.send("/reset", "Enter")
        tmux.wait_for(lambda s: "[conversation cleared]" in s and _prompts(s) == 2, "/reset's confirmation")
        tmux.send("Tell me a very long story about a dragon.", "Enter")
        # Wait for the reply to stream: a line of output after the question.
        tmux.wait_for(lambda s: len(s.split("dragon.", 1)[-1].strip()) > 20, "the reply to stream")
        tmux.send("C-c")
        screen = tmux.wait_for(lambda s: _prompts(s) == 3, "the prompt after Ctrl-C")
        assert "[interrupted]" in screen
        tmux.send(exit_key)
        screen = tmux.wait_for(lambda s: "EXIT=" in s, "EXIT=")
        assert "EXIT=0" in screen
        assert "Traceback" not in screen and "KeyboardInterrupt" not in screen
        assert " INFO " not in screen  # the REPL logs warnings only, without -v
    finally:
        tmux.close()


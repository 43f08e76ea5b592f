"""The ``pagedllm`` command: --version and --help without torch, every default shown once, bad
flags refused before a model loads under the flag's own name, and the chat REPL's /reset and
Ctrl-C / Ctrl-D handling (under tmux, a real terminal)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm import LLM, __version__
from pagedllm.entrypoints.chat_repl import stream_reply
from pagedllm.config import EngineConfig
from pagedllm.default_model import DEFAULT_MODEL
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser, check_args, main
from pagedllm.kernels.attention import MAX_PREFILL_BLOCK
from pagedllm.scheduler_defaults import MAX_NUM_BATCHED_TOKENS, SERVE_MAX_NUM_BATCHED_TOKENS
from tests.utils import pool_is_whole

SMALL = ["--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--dtype", "float32"]
ROOT = Path(__file__).resolve().parents[1]  # the tree under test, wherever pytest was started from


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagedllm {__version__}"


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_help_shows_every_default() -> None:
    parsers = _parsers(build_parser())
    assert {p.prog for p in parsers} >= {"pagedllm generate", "pagedllm chat", "pagedllm serve",
                                         "pagedllm bench throughput", "pagedllm bench serve"}
    for parser in parsers:
        formatter = parser._get_formatter()
        assert isinstance(formatter, argparse.ArgumentDefaultsHelpFormatter), parser.prog
        parser.format_help()  # renders
        for action in parser._actions:
            if action.default is argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue
            shown = formatter._get_help_string(action)
            assert "%(default)" in shown or "(default: " in shown, (parser.prog, action.dest)
            assert shown.count("(default: ") == 1, (parser.prog, action.dest, shown)  # once, not twice


def test_block_size_help_names_the_prefill_kernel_limit() -> None:
    generate = next(p for p in _parsers(build_parser()) if p.prog == "pagedllm generate")
    help_text = generate.format_help()
    assert f"above {MAX_PREFILL_BLOCK} prefill attention runs in PyTorch" in " ".join(help_text.split())


def test_serve_takes_smaller_steps_than_offline_commands() -> None:
    """`serve`'s token budget is the serving default (first tokens sooner under load); the
    offline commands keep the engine's."""
    parser = build_parser()
    assert parser.parse_args(["serve"]).max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS
    assert parser.parse_args(["serve", "--max-num-batched-tokens", "1024"]).max_num_batched_tokens == 1024
    assert parser.parse_args(["generate", "--prompt", "x"]).max_num_batched_tokens == MAX_NUM_BATCHED_TOKENS
    assert SERVE_MAX_NUM_BATCHED_TOKENS < MAX_NUM_BATCHED_TOKENS == EngineConfig().max_num_batched_tokens


BAD_FLAGS = [
    (["generate", "--prompt", "x", "--max-num-seqs", "0"], "max-num-seqs"),
    (["generate", "--prompt", "x", "--dtype", "fp7"], "dtype"),
    (["generate", "--prompt", "x", "--kv-cache-memory", "lots"], "memory size"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "temperature"),
    (["generate", "--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["generate", "--prompt", "x", "--repetition-penalty", "0"], "--repetition-penalty must be greater than 0"),
    (["generate", "--prompt", "x", "--prompt", ""], "--prompt must not be empty (an empty message is taken with --chat)"),
    (["chat", "--block-size", "7"], "--block-size must be one of"),
    (["chat", "--max-tokens", "0"], "max-tokens"),
    (["serve", "--max-num-batched-tokens", "-1"], "max-num-batched-tokens"),
    (["serve", "--quantization", "int3"], "quantization"),
    (["serve", "--timeout-keep-alive", "0"], "timeout-keep-alive"),
    (["serve", "--timeout-request-head", "inf"], "timeout-request-head"),
    (["serve", "--limit-concurrency", "0"], "limit-concurrency"),
    (["bench", "throughput", "--kv-cache-dtype", "int2"], "--kv-cache-dtype must be"),
    (["bench", "throughput", "--num-prompts", "0"], "argument --num-prompts: must be at least 1, got 0"),
    (["bench", "spec", "--repeats", "-1"], "argument --repeats: must be at least 1, got -1"),
    (["bench", "step", "--context", "0"], "argument --context: must be at least 1, got 0"),
    (["bench", "serve", "--max-concurrency", "0"], "argument --max-concurrency: must be at least 1, got 0"),
    (["bench", "gemm", "--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["bench", "perplexity", "--file", "/no/such/text.txt"], "argument --file: /no/such/text.txt is not a file"),
    (["bench", "perplexity", "--compare", "int8,int3"], "argument --compare: unknown modes ['int3']; choose from"),
    (["bench", "spec", "--batch-sizes", "1,0"], "argument --batch-sizes: must be at least 1, got 0"),
    (["bench", "spec", "--workloads", "copy,nope"], "argument --workloads: must be a comma list of copy, open"),
    (["bench", "step", "--batch-sizes", "-1"], "argument --batch-sizes: must be at least 1, got -1"),
    (["bench", "long-context", "--context-lens", "4k"], "argument --context-lens: must be an integer, got '4k'"),
    (["bench", "lora", "--adapter-counts", "x"], "argument --adapter-counts: must be an integer, got 'x'"),
    (["bench", "attention", "--batch-sizes", ","], "argument --batch-sizes: must be a comma list"),
    (["bench", "gemm", "--rows", "1,x"], "argument --rows: must be an integer, got 'x'"),
    (["serve", "--max-model-len", "1k"], "argument --max-model-len: must be an integer, got '1k'"),
    (["serve", "--port", "http"], "argument --port: must be an integer, got 'http'"),
    (["bench", "throughput", "--input-len-range", "10-5"], "argument --input-len-range: must be LO:HI (or N)"),
    (["bench", "serve", "--output-len-range", "4:2"], "argument --output-len-range: must be LO:HI (or N)"),
    (["bench", "throughput", "--result-json", "/no/such/dir/r.json"], "argument --result-json: /no/such/dir is not a"),
    (["bench", "throughput", "--trace", "/"], "argument --trace: / is a directory, not a file"),
    (["bench", "serve", "--result-json", "/no/such/dir/r.json"], "argument --result-json: /no/such/dir is not a"),
    (["generate", "--prompt", "x", "--json-schema", "{not json"], "json-schema"),
    (["generate", "--prompt", "x", "--json-schema", '{"type": "strin"}'], "error: --json-schema: the schema cannot be compiled"),
    (["generate", "--prompt", "x", "--chat", "--chat-template", "{% for %}"], "--chat-template: the template does not parse"),
    (["serve", "--chat-template", "no/such/template.jinja"], "--chat-template: 'no/such/template.jinja' is no file"),
    (["serve", "--max-request-body-size", "huge"], "--max-request-body-size: cannot parse memory size"),
    (["generate", "--prompt", "x", "--sampling-seed", str(2**64)], "error: --sampling-seed must fit in 64 bits"),
    (["serve", "--seed", str(2**64)], "error: --seed must fit in 64 bits"),
    (["serve", "--max-grammar-bytes", "0"], "error: --max-grammar-bytes must be positive, got 0"),
    (["serve", "--grammar-compile-timeout", "nan"], "error: --grammar-compile-timeout must be positive, got nan"),
    (["generate", "--prompt", "x", "--kv-cache-memory", "inf"], "--kv-cache-memory: memory size must be at least"),
    (["serve", "--kv-cache-memory=-1GiB"], "--kv-cache-memory: memory size must be at least one byte"),
    (["serve", "--max-request-body-size", "0"], "--max-request-body-size: memory size must be at least one byte"),
    (["serve", "--enable-lora", "--lora-modules", '{"name": "a", "path": "/a", "rank": 8}'],
     "--lora-modules: unknown key 'rank' in"),
    (["serve", "--enable-lora", "--lora-modules", '{"name": "a"}'], """--lora-modules: '{"name": "a"}' lacks 'path'"""),
]


@pytest.mark.parametrize(("argv", "needle"), BAD_FLAGS)
def test_bad_flag_exits_2_before_loading(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("pagedllm.engine.core.EngineCore.__init__", no_load)
    monkeypatch.setattr("pagedllm.worker.worker.load_model", no_load)
    monkeypatch.setattr("pagedllm.engine.async_llm.AsyncLLM.__init__", no_load)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_an_empty_prompt_is_a_chat_message_with_chat() -> None:
    """Without --chat an empty --prompt is refused before loading (it was refused only after
    the model had loaded); with --chat the template's tokens surround the empty message."""
    argv = ["generate", "--prompt", "", "--chat"]
    check_args(build_parser(argv).parse_args(argv))


def test_bench_kv_memory_runs_on_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    """Its default model was gemma-3-270m, which the default install lacks: it failed as typed.
    The default model has no sliding window, so release on and off hold the same blocks."""
    main(["bench", "kv-memory", "--num-requests", "2", "--prompt-len", "64", "--output-len", "2"])
    title, on, off = capsys.readouterr().out.splitlines()
    assert title.startswith(f"{DEFAULT_MODEL}: 2 requests of 64 prompt + 2 output tokens")
    assert on.removeprefix("[release on]") == off.removeprefix("[release off]")


def test_serve_takes_the_model_as_positional_or_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's ``serve --model X`` (README: every command takes --model) was an unrecognized argument."""
    parser = build_parser()
    assert parser.parse_args(["serve", "--model", "smollm2", "--port", "1"]).model == "smollm2"
    assert parser.parse_args(["serve", "--port", "1", "smollm2"]).model == "smollm2"
    assert parser.parse_args(["serve", "smollm2", "--model", "smollm2"]).model == "smollm2"
    assert parser.parse_args(["serve"]).model == EngineConfig().model
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["serve", "smollm2", "--model", "other"])
    assert e.value.code == 2
    assert "the model is given twice: 'smollm2' and 'other'" in capsys.readouterr().err


def test_generation_config_is_a_flag_of_serve_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """generate, chat and bench set every sampling field from their own flags, so a
    generation_config.json default would never apply there: the flag is refused, not ignored."""
    parser = build_parser()
    assert parser.parse_args(["serve", "--generation-config", "vllm"]).generation_config == "vllm"
    assert EngineArgs.from_cli_args(parser.parse_args(["generate", "--prompt", "hi"])).generation_config == "auto"
    for argv in (["generate", "--prompt", "hi"], ["chat"], ["bench", "throughput"]):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--generation-config", "vllm"])
        assert e.value.code == 2
        assert "unrecognized arguments: --generation-config" in capsys.readouterr().err


def test_serve_binds_its_port_before_loading(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port in use is named at once (as vLLM binds first), not by uvicorn after the model loaded."""
    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("pagedllm.engine.async_llm.AsyncLLM.__init__", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--port", str(port)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --host '127.0.0.1' --port {port}: cannot bind the address: Address already in use" in err


@pytest.mark.parametrize(("argv", "prog"), [(["serve", "--gpu-memory-utilization", "0.9"], "pagedllm serve"),
                                            (["bench", "throughput", "--input-len", "8", "--bogus"],
                                             "pagedllm bench throughput")])
def test_an_unknown_flag_is_refused_under_its_command(argv: list[str], prog: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Under the command's usage and --help, which list its flags (the top level's lists none)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{prog}: error: unrecognized arguments: --" in err and f"(`{prog} --help` lists every flag)" in err


def test_a_vllm_only_flag_says_what_to_use_instead(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--gpu-memory-utilization=0.9"])
    assert ("unrecognized arguments: --gpu-memory-utilization=0.9; --gpu-memory-utilization: the KV cache is sized "
            "in bytes here, by kv_cache_memory / --kv-cache-memory") in capsys.readouterr().err


def test_bench_serve_without_a_server_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    """Every request failing printed a report of zeros and exited 0, which scripts took for a run."""
    with socket.socket() as closed:  # bound, not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(SystemExit) as e:
            main(["bench", "serve", "--base-url", url, "--num-prompts", "2", "--input-len-range", "4",
                  "--output-len-range", "2"])
    assert e.value.code == "error: none of the 2 requests succeeded (their errors are above)"
    assert "Failed requests                                                  2" in capsys.readouterr().out


def test_a_bad_sampling_value_names_the_flag_under_its_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--top-p", "0"])
    err = capsys.readouterr().err
    assert "usage: pagedllm generate --prompt TEXT [--prompt TEXT ...] [options]\n" in err  # one short line
    assert "pagedllm generate: error: --top-p must be in (0, 1], got 0" in err and "--max-num-seqs" not in err


# What the command line may import before a command runs: no deep-learning library, no server.
_HEAVY = ("torch", "transformers", "numpy", "fastapi", "uvicorn")


def _heavy_modules_after(argv: list[str], code: int) -> tuple[str, str, str]:
    """In a fresh interpreter, as the ``pagedllm`` script runs argv (exiting with ``code``): the
    heavy modules loaded by the time it exits, and its stdout and stderr."""
    script = ("import sys\nfrom pagedllm.entrypoints.cli import main\ntry:\n    main(sys.argv[1:])\n"
              f"except SystemExit as e:\n    assert e.code == {code}, e.code\n"
              f"print(sorted(m for m in {_HEAVY!r} if m in sys.modules), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr.strip().splitlines()[-1], done.stdout, done.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["generate", "--help"], ["serve", "--help"],
                                  ["bench", "--help"], ["env", "--help"]])
def test_help_and_version_import_no_heavy_module(argv: list[str]) -> None:
    """In a fresh interpreter, as the ``pagedllm`` script runs: the modules loaded by the time it exits."""
    heavy, out, err = _heavy_modules_after(argv, 0)
    assert heavy == "[]", err
    assert out.strip()


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--prompt", "x", "--dtype", "fp7"], "--dtype must be one of"),
    (["serve", "--kv-cache-dtype", "int4"], "--kv-cache-dtype must be auto"),
    (["bench", "throughput", "--block-size", "7"], "--block-size must be one of"),
    (["chat", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["serve", "--quantization", "int3"], "--quantization must be one of"),
    (["generate", "--prompt", "x", "--speculative-config", '{"method": "nope", "num_speculative_tokens": 2}'],
     "--speculative-config method must be one of"),
    (["generate", "--prompt", "x", "--kv-cache-memory", "lots"], "--kv-cache-memory: cannot parse memory size"),
    (["serve", "--lora-modules", "a"], "--lora-modules takes name=path or JSON object items"),
])
def test_bad_engine_and_sampling_flags_are_refused_before_heavy_imports(argv: list[str], message: str) -> None:
    """A name or value the engine, the sampler or the server refuses is a usage error before
    torch or transformers load (they take seconds): ``EngineArgs.check`` (names and parsers
    declared without torch in ``pagedllm.config_values``), the structured-output backend loaded
    only for a schema, ``--lora-modules`` parsed without the engine client."""
    heavy, _, err = _heavy_modules_after(argv, 2)
    assert heavy == "[]", err
    assert message in err, err


def test_first_log_line_comes_before_heavy_imports(capsys: pytest.CaptureFixture[str]) -> None:
    """``serve`` logs that it started before it imports torch (checked in a fresh interpreter
    whose flags fail the last check, the engine's)."""
    script = ("import logging, sys\nfrom pagedllm.entrypoints.cli import main\n"
              "class Probe(logging.Handler):\n"
              "    def emit(self, record):\n"
              "        print('torch' in sys.modules, record.getMessage(), file=sys.stderr)\n"
              "logging.getLogger('pagedllm').addHandler(Probe())\n"
              "main(sys.argv[1:])")
    done = subprocess.run([sys.executable, "-c", script, "serve", "--block-size", "7"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2 and "--block-size must be one of" in done.stderr, done.stderr
    first = next(line for line in done.stderr.splitlines() if line.startswith(("True ", "False ")))
    assert first.startswith("False pagedllm ") and "serve" in first, done.stderr


def test_serve_refuses_a_setting_the_model_cannot_take_in_one_line() -> None:
    """A ValueError from the engine core's start (here --max-model-len past the model's context,
    which only the loaded config can tell) used to print the core's traceback first."""
    done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", "0",
                           "--max-model-len", "100000", "--kv-cache-memory", "64MiB"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    assert "engine core failed to start: ValueError: max_model_len must be in [1, 8192]" in done.stderr


def test_generate_json_schema_from_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    main(["generate", "--prompt", "My favourite color is", "--json-schema", str(path), "--json", "--max-tokens", "20",
          *SMALL])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["finish_reason"] == "stop" and json.loads(record["text"])["color"] in ("red", "green", "blue")


def test_a_json_schema_file_that_cannot_be_read_is_named(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes that are not UTF-8 (and a file without read permission) escaped as a bare
    UnicodeDecodeError (a PermissionError traceback) instead of an error naming the flag."""
    path = tmp_path / "schema.json"
    path.write_bytes(b'\xff{"type": "object"}')
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--json-schema", str(path)])
    assert e.value.code == 2
    assert f"error: --json-schema: cannot read {path}: 'utf-8' codec can't decode" in capsys.readouterr().err


def test_generate_chat_with_an_inline_chat_template(capsys: pytest.CaptureFixture[str]) -> None:
    """``--chat-template`` on one line, ``\\n`` escapes decoded, replaces the model's template."""
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\\n{{ m['content'] }}<|im_end|>\\n{% endfor %}Reply:"
    main(["generate", "--chat", "--chat-template", template, "--prompt", "Hi", "--json", "--max-tokens", "2", *SMALL])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["prompt"] == "<|im_start|>user\nHi<|im_end|>\nReply:"


def test_chat_replies_within_a_short_context(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`chat --max-model-len 128` refused every turn (prompt + the default --max-tokens 512 >
    128): a reply now takes what the context has left, and a conversation grown past the
    context is refused naming /reset."""
    lines = iter(["Tell me a long story about a dragon.", "Go on, in detail. " * 30, "/reset", "Hi!"])

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

"""What the ``pagedllm`` command imports before a command runs: no torch for --help, --version or a refused flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server_util import ROOT

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


"""The ``pagedllm`` command's parser: --version, every default shown once in --help, serve's own defaults."""

from __future__ import annotations

import argparse

import pytest

from pagedllm import __version__
from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.kernels.attention import MAX_PREFILL_BLOCK
from pagedllm.scheduler_defaults import MAX_NUM_BATCHED_TOKENS, SERVE_MAX_NUM_BATCHED_TOKENS


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
        assert "(default: )" not in " ".join(parser.format_help().split()), parser.prog  # an empty list: "none"


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


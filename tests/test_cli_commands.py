"""The ``pagedllm`` commands run: generate (a JSON schema file, an inline chat template), bench, serve's refusal."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from pagedllm.default_model import DEFAULT_MODEL
from pagedllm.entrypoints.cli import main
from tests.server_util import CLI_SMALL as SMALL
from tests.server_util import ROOT


def test_bench_kv_memory_runs_on_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    """Its default model was gemma-3-270m, which the default install lacks: it failed as typed.
    The default model has no sliding window, so release on and off hold the same blocks."""
    main(["bench", "kv-memory", "--num-requests", "2", "--prompt-len", "64", "--output-len", "2"])
    title, on, off = capsys.readouterr().out.splitlines()
    assert title.startswith(f"{DEFAULT_MODEL}: 2 requests of 64 prompt + 2 output tokens")
    assert on.removeprefix("[release on]") == off.removeprefix("[release off]")


def test_bench_long_context_skips_lengths_past_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    """Its default lengths (up to 16384) failed on the default model (8192 tokens) as typed, and
    a --max-model-len given was overridden: lengths past either are reported as skipped."""
    main(["bench", "long-context", "--no-llama-cpp", "--context-lens", "64,20000", "--output-len", "2",
          "--batch-sizes", "1", "--kv-cache-memory", "64MiB"])
    out = capsys.readouterr().out
    assert "context 20000 skipped: with --output-len 2 it is past the model's context (8192 tokens)" in out
    assert "context     64: prefill" in out
    with pytest.raises(SystemExit) as e:
        main(["bench", "long-context", "--no-llama-cpp", "--context-lens", "64", "--max-model-len", "32"])
    assert e.value.code == 2
    assert "every length with --output-len 32 is past --max-model-len (32 tokens)" in capsys.readouterr().err


def test_bench_serve_without_a_server_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    """Every request failing printed a report of zeros and exited 0, which scripts took for a run."""
    with socket.socket() as closed:  # bound, not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(SystemExit) as e:
            main(["bench", "serve", "--base-url", url, "--num-prompts", "2", "--input-len-range", "4",
                  "--output-len-range", "2", "--request-rate", "50", "--max-concurrency", "1"])
    assert e.value.code == "error: none of the 2 requests succeeded (their errors are above)"
    out = capsys.readouterr().out
    assert "Failed requests                                                  2" in out
    assert "50.0 req/s, max concurrency 1" in out  # both, as vLLM's (they were refused together)


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


def test_chat_without_a_chat_template_says_so_before_a_turn(tmp_path, tokenizer_dir, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A model without a chat template (Gemma 3's GGUF): ``generate --chat`` and ``chat`` stop
    once it has loaded, naming --chat-template (``chat`` asked for a turn, then failed in
    transformers' words; ``generate --chat`` blamed the message)."""
    from tests.models_util import save_checkpoint, tiny_llama

    llama = tiny_llama(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    save_checkpoint(llama, tmp_path, tokenizer_dir)
    (tmp_path / "chat_template.jinja").unlink()
    monkeypatch.setattr("builtins.input", lambda prompt: pytest.fail("chat asked for a turn"))
    for argv in (["generate", "--chat", "--prompt", "Hi"], ["chat"]):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--model", str(tmp_path), "--dtype", "float32", "--kv-cache-memory", "64MiB"])
        assert e.value.code == 2
        assert f"{tmp_path} has no chat template: give one with --chat-template" in capsys.readouterr().err


def test_generate_chat_with_an_inline_chat_template(capsys: pytest.CaptureFixture[str]) -> None:
    """``--chat-template`` on one line, ``\\n`` escapes decoded, replaces the model's template."""
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\\n{{ m['content'] }}<|im_end|>\\n{% endfor %}Reply:"
    main(["generate", "--chat", "--chat-template", template, "--prompt", "Hi", "--json", "--max-tokens", "2", *SMALL])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["prompt"] == "<|im_start|>user\nHi<|im_end|>\nReply:"


def test_generate_json_names_the_stop_string_that_ended_it(capsys: pytest.CaptureFixture[str]) -> None:
    """With several --stop strings, which one fired was not in the record (vLLM's stop_reason)."""
    main(["generate", "--prompt", "One, two, three,", "--stop", " four", "--stop", "five", "--json",
          "--max-tokens", "20", *SMALL])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (record["finish_reason"], record["stop_reason"]) == ("stop", " four")



def test_a_broken_hf_checkpoint_is_one_line_and_exit_2(tmp_path, tokenizer_dir,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A config.json that is not JSON, and a checkpoint without one of the model's tensors,
    are named in one line (exit 2), not transformers' or torch's tracebacks (exit 1)."""
    import safetensors.torch

    from tests.models_util import save_checkpoint, tiny_llama

    llama = tiny_llama(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    save_checkpoint(llama, tmp_path, tokenizer_dir)
    weights = next(tmp_path.glob("*.safetensors"))
    tensors = safetensors.torch.load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    safetensors.torch.save_file(tensors, weights)
    argv = ["generate", "--prompt", "Hi", "--model", str(tmp_path), "--dtype", "float32", "--kv-cache-memory", "64MiB"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error: the checkpoint lacks layers.1.mlp.down_proj.weight" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"{tmp_path / 'config.json'} is not valid JSON" in capsys.readouterr().err

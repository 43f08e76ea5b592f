"""Bad flags refused before a model loads, with exit status 2, under the flag's own name and its command's usage."""

from __future__ import annotations

import socket

import pytest

from pagedllm.entrypoints.cli import build_parser, check_args, main

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
    # Names taken twice, or the base model's: refused before the model loads (was: after, ~9 s).
    (["serve", "--enable-lora", "--lora-modules", "a=/x", "a=/y"], "--lora-modules a=/y: the model name 'a' is"),
    (["serve", "--served-model-name", "m", "--enable-lora", "--lora-modules", "m=/x"], "the model name 'm' is already"),
    (["bench", "throughput", "--kv-cache-dtype", "int2"], "--kv-cache-dtype must be"),
    # from the model's config, before the engine starts (was: from the engine core, after the API server's start)
    (["serve", "-dp", "2", "-tp", "2"], "--tensor-parallel-size 2 does not divide SmolLM2-135M-Instruct's 9"),
    (["generate", "--prompt", "x", "-tp", "2"], "--tensor-parallel-size 2 does not divide"),
    (["bench", "throughput", "--num-prompts", "0"], "argument --num-prompts: must be at least 1, got 0"),
    (["bench", "spec", "--repeats", "-1"], "argument --repeats: must be at least 1, got -1"),
    (["bench", "step", "--context", "0"], "argument --context: must be at least 1, got 0"),
    (["bench", "serve", "--max-concurrency", "0"], "argument --max-concurrency: must be at least 1, got 0"),
    (["bench", "serve", "--request-rate", "0"], "argument --request-rate: must be above 0, got '0'"),  # was a traceback
    (["bench", "serve", "--request-rate", "nan"], "argument --request-rate: must be above 0, got 'nan'"),
    (["bench", "serve", "--burstiness", "0"], "argument --burstiness: must be above 0, got '0'"),
    # was a tokenizer load, then every request failing:
    (["bench", "serve", "--base-url", "notaurl"], "argument --base-url: must be an http:// or https:// URL"),
    (["bench", "gemm", "--threads", "0"], "argument --threads: must be at least 1, got 0"),
    # each was taken and failed (or did nothing) later:
    (["bench", "throughput", "--compare-kv-cache-dtype", "foo"],
     "argument --compare-kv-cache-dtype: kv_cache_dtype must"),
    (["bench", "serve", "--base-url", "http://127.0.0.1:9", "--seed", "-1"],
     "argument --seed: must be 0 or more, got -1"),
    (["bench", "attention", "--block-size", "7"], "argument --block-size: block_size must be one of 8, 16"),
    (["bench", "kv-memory", "--kv-cache-memory", "0"],  # was "invalid parse_memory value"
     "argument --kv-cache-memory: memory size must be at least one byte and finite, got '0'"),
    (["bench", "perplexity", "--file", "/no/such/text.txt"], "argument --file: /no/such/text.txt is not a file"),
    (["bench", "perplexity", "--compare", "int8,int3"], "argument --compare: unknown modes ['int3']; choose from"),
    (["bench", "spec", "--batch-sizes", "1,0"], "argument --batch-sizes: must be at least 1, got 0"),
    (["bench", "spec", "--workloads", "copy,nope"], "argument --workloads: must be a comma list of copy, open"),
    (["bench", "spec", "--num-prompts", "9"], "argument --num-prompts: a workload holds 8 prompts, got 9"),  # ran 8
    (["generate", "--prompt", "hi", "--worker-timeout-s", "0"], "--worker-timeout-s must be above 0, got 0.0"),
    (["generate", "--prompt", "hi", "--speculative-config",
      '{"method": "draft_model", "model": "/no/draft.gguf", "num_speculative_tokens": 2}'],
     "--speculative-config: the draft model '/no/draft.gguf': no such file or directory"),  # unnamed, after loading
    (["generate", "--prompt", "hi", "--ray-placement-strategy", "SPREAD"],  # ignored without Ray
     "--ray-placement-strategy SPREAD places Ray actors: it needs distributed_executor_backend ray, not uni"),
    (["bench", "throughput", "--compare-kv-cache-dtype", "fp8"],  # ignored without --compare kv-cache-dtype
     "--compare-kv-cache-dtype is the second run of --compare kv-cache-dtype, which is not given"),
    (["serve", "--served-model-name", "a", "b", "a"], "--served-model-name: 'a' is given twice"),  # listed twice
    (["bench", "step", "--batch-sizes", "-1"], "argument --batch-sizes: must be at least 1, got -1"),
    (["bench", "long-context", "--context-lens", "4k"], "argument --context-lens: must be an integer, got '4k'"),
    (["bench", "lora", "--adapter-counts", "x"], "argument --adapter-counts: must be an integer, got 'x'"),
    (["bench", "attention", "--batch-sizes", ","], "argument --batch-sizes: must be a comma list"),
    (["bench", "gemm", "--rows", "1,x"], "argument --rows: must be an integer, got 'x'"),
    (["bench", "gemm", "--rows", "1,,2"], "argument --rows: must be a comma list with no empty item"),  # was 1,2
    (["bench", "gemm", "--threads", "100000"], "argument --threads: must be at most the"),  # was 100000 threads
    (["genrate"], "invalid choice: 'genrate' (choose from 'generate', 'chat', 'bench', 'env', 'serve'); did you mean generate?"),
    (["bench", "stp"], "; did you mean step?"),
    (["generate", "--prompt", "hi", "--kv-cache-memory", "-5GiB"], "(a value that starts with '-' is written --kv-cache-memory=-VALUE)"),
    (["bench", "gemm", "--kinds", ""], "argument --kinds: must be a comma list with no empty item"),  # was f32 alone
    (["bench", "gemm", "--kinds", "f32,w4"], "argument --kinds: unknown w4; choose from f32, w8a8, w4a8, q4_0"),
    (["generate", "--model", "/no/such/model.gguf", "--prompt", "hi"], "--model '/no/such/model.gguf': no such file"),
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


def test_a_bad_sampling_value_names_the_flag_under_its_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--top-p", "0"])
    err = capsys.readouterr().err
    assert "usage: pagedllm generate --prompt TEXT [--prompt TEXT ...] [options]\n" in err  # one short line
    assert "pagedllm generate: error: --top-p must be in (0, 1], got 0" in err and "--max-num-seqs" not in err


def test_a_json_schema_file_that_cannot_be_read_is_named(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes that are not UTF-8 (and a file without read permission) escaped as a bare
    UnicodeDecodeError (a PermissionError traceback) instead of an error naming the flag."""
    path = tmp_path / "schema.json"
    path.write_bytes(b'\xff{"type": "object"}')
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--json-schema", str(path)])
    assert e.value.code == 2
    assert f"error: --json-schema: cannot read {path}: 'utf-8' codec can't decode" in capsys.readouterr().err



def test_sizes_past_memory_end_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A benchmark asked for more memory than there is says so in a line and exits 1 (was a
    torch allocation traceback)."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "gemm", "--rows", str(10**11), "--kinds", "f32", "--shapes", "smollm2-135m", "--repeats", "1"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "error: what the flags ask for does not fit in this machine's memory" in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--promt", "hi"], "pagedllm generate: error: unrecognized arguments: --promt; did you mean --prompt?"),
    (["generate", "--prompt", "x", "--max-tok", "3"], "unrecognized arguments: --max-tok; did you mean --max-tokens?"),
    (["--versoin"], "pagedllm: error: unrecognized arguments: --versoin; did you mean --version?"),
])
def test_a_mistyped_flag_is_named_before_a_missing_one(argv: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """--promt was reported as --prompt missing, --versoin as the command missing; a prefix
    (--max-tok) was taken for the flag it begins, as vLLM does not."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_lora_flags_are_the_servers(capsys: pytest.CaptureFixture[str]) -> None:
    """Only requests name adapters: generate took --enable-lora and the other LoRA flags and did
    nothing with them; they are serve's (bench lora sets its own)."""
    for flag in ("--enable-lora", "--max-loras=3", "--max-lora-rank=8", "--max-cpu-loras=2", "--lora-dtype=float32"):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--prompt", "hi", flag])
        assert e.value.code == 2
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err

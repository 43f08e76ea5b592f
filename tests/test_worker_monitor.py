"""Tensor-parallel ranks that hang, die or are shut down: a hung rank fails the step with an
engine error after ``worker_timeout_s``, a dead one at once (even one that died while the
engine idled), and a normal shutdown prints no traceback from any rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.executor.executor import WorkerDiedError
from pagedllm.models.loader import load_tokenizer, resolve_model
from tests.server_util import ROOT

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory="8MiB", max_model_len=128, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random llama whose 4 heads and 2 KV heads split in 2, with SmolLM2's tokenizer."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    load_tokenizer(resolve_model("smollm2")).save_pretrained(path)
    return str(path)


@pytest.fixture
def llm(tiny_llama: str) -> Iterator[LLM]:
    llm = LLM(model=tiny_llama, worker_timeout_s=3, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


def _rank1(llm: LLM) -> subprocess.Popen:
    (proc,) = llm.engine.core.executor.procs
    return proc


def test_a_hung_rank_fails_the_step_after_the_timeout(llm: LLM) -> None:
    assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4
    os.kill(_rank1(llm).pid, signal.SIGSTOP)  # alive, but answers nothing
    with pytest.raises(WorkerDiedError, match="did not answer within worker_timeout_s=3 s"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    llm.shutdown()  # kills the stopped rank instead of waiting for it
    assert not llm.engine.core.executor.procs


def test_a_rank_that_died_while_idle_fails_the_next_step(llm: LLM) -> None:
    proc = _rank1(llm)
    proc.kill()
    proc.wait()
    assert llm.engine.core.executor.sender.wait_dead(30)  # the monitor saw its connection close
    with pytest.raises(WorkerDiedError, match="rank 1 is gone"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("shutdown", ["llm.shutdown()", "pass"])  # explicit, or at the interpreter's exit
def test_three_ranks_leave_without_a_traceback(shutdown: str) -> None:
    script = textwrap.dedent(f"""
        from pagedllm import LLM, SamplingParams
        llm = LLM(dtype="float32", kv_cache_memory="32MiB", max_model_len=256, tensor_parallel_size=3)
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        {shutdown}
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]

"""The Ray executor: tensor-parallel ranks as actors on a local two-node Ray cluster (both nodes
on this machine), equal to the in-process engine; placement and missing-package errors."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.executor import ray_executor
from pagedllm.executor.executor import WorkerDiedError
from pagedllm.executor.factory import create_executor
from pagedllm.models.loader import load_tokenizer, resolve_model

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(10, 50)), [33] * 20]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random llama whose 4 heads and 2 KV heads split in 2 (SmolLM2's 9 heads do not), as an HF
    checkpoint directory with SmolLM2's tokenizer; weights large enough that greedy tokens vary."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.3,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    load_tokenizer(resolve_model("smollm2")).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[object]:
    """Two Ray nodes of one CPU each; this process is connected (a session the executor reuses)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()
        # The head wrote its address for ray.init(address="auto"); it would outlive the cluster.
        address_file = Path(ray._common.utils.get_ray_address_file(None))
        if address_file.exists() and address_file.read_text().strip() == cluster.address:
            address_file.unlink()


@pytest.fixture(scope="module")
def ray_llm(tiny_llama: str, two_nodes) -> Iterator[LLM]:
    """Tensor-parallel size 2 with one rank on each node."""
    llm = LLM(**ENGINE_ARGS, model=tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray",
              ray_placement_strategy="STRICT_SPREAD")
    yield llm
    llm.shutdown()


def test_one_rank_per_node_matches_in_process(tiny_llama: str, two_nodes, ray_llm: LLM) -> None:
    reference = LLM(**ENGINE_ARGS, model=tiny_llama)
    expected = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    reference.shutdown()
    assert set(ray_llm.engine.core.executor.bundle_nodes) == {n["NodeID"] for n in two_nodes.nodes()}
    for out, ref in zip(ray_llm.generate(PROMPTS, GREEDY, use_tqdm=False), expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for lp, ref_lp, token in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, ref.outputs[0].token_ids):
            assert math.isclose(lp[token].logprob, ref_lp[token].logprob, abs_tol=1e-4)


def test_unplaceable_group_names_the_resources(tiny_llama: str, two_nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(RuntimeError, match="could not place 4 bundles .*STRICT_SPREAD.*free on 2 node"):
        LLM(**ENGINE_ARGS, model=tiny_llama, tensor_parallel_size=4, distributed_executor_backend="ray",
            ray_placement_strategy="STRICT_SPREAD")


def test_a_killed_actor_fails_the_step_and_shutdown_cleans_up(two_nodes, ray_llm: LLM) -> None:
    two_nodes.kill(ray_llm.engine.core.executor._actors[0])
    with pytest.raises(WorkerDiedError):
        ray_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ray_llm.shutdown()
    assert {pg["state"] for pg in two_nodes.util.placement_group_table().values()} <= {"REMOVED"}
    assert two_nodes.is_initialized()  # the session was this process's: left running


def test_missing_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray then raises ImportError
    config = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ImportError, match=r"pip install 'pagedllm\[ray\]'"):
        create_executor(config, kv=None)


def test_ranks_share_their_host_and_bundles_fit() -> None:
    assert ray_executor.host_shares(["a", "b", "a", "a"]) == [(0, 3), (0, 1), (1, 3), (2, 3)]
    assert ray_executor.bundle_cpus("STRICT_PACK", [2.0, 8.0], 2) == 1.0
    assert ray_executor.bundle_cpus("STRICT_PACK", [2.0, 8.0], 3) == 0.6666  # the driver's node must hold all
    assert ray_executor.bundle_cpus("SPREAD", [1.0, 1.0, 1.0], 3) == 1.0

"""Mixture-of-experts models at 2 ranks: each expert's width split, the unsharded logits, float32 and quantized."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.distributed.sharding import ModelShard, check_tensor_parallel_size
from pagedllm.models.loader import load_config, resolve_model
from tests.models_util import MOE_CONFIGS as CONFIGS
from tests.models_util import MOE_HF_CLASSES as HF_CLASSES
from tests.models_util import randomize_vectors
from tests.models_util import tiny  # noqa: F401 (the fixture)
from tests.tensor_parallel_ranks import Case, reference, run_group

# (architecture, quantization, seed of the random weights). Quantized, the ranks' logits are
# the unsharded ones bit for bit unless a token's activation sits on a rounding edge (an int8
# code, or a bfloat16 one on AMX's prompt rows) that the ranks' other sum order crosses: that
# token's logits and its request's later ones move by up to ~2 (seen at other seeds). The seeds
# are ones with no such edge under either kernel.
TP_CASES = [
    ("qwen3_moe", None, 0), ("mixtral", None, 0), ("qwen3_moe", ("w8a8", 32, True), 1), ("mixtral", ("w4a8", 32, True), 0)
]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """(unsharded logits, rank 0's logits at 2 ranks) per case: float32 and quantized experts."""
    root = tmp_path_factory.mktemp("moe-tp")
    cases = []
    for arch, quant, seed in TP_CASES:
        torch.manual_seed(seed)
        hf = HF_CLASSES[arch](CONFIGS[arch]()).eval()
        randomize_vectors(hf)
        hf.save_pretrained(root / arch)
        cases.append(Case(f"{arch}-{quant[0] if quant else 'float32'}", str(root / arch), quant))
    return reference(cases), run_group(cases, 2, root / "logits.pt")


@pytest.mark.parametrize("name", [f"{a}-{q[0] if q else 'float32'}" for a, q, _ in TP_CASES])
def test_two_ranks_give_the_unsharded_logits(tp_runs, name: str) -> None:
    """Each rank holds half of every expert's intermediate features and the whole router;
    quantized experts see the same codes and activation groups (only the sum order differs)."""
    expected, got = tp_runs
    assert not isinstance(got[name], str), got[name]
    torch.testing.assert_close(got[name], expected[name], atol=1e-4 if "float32" in name else 1e-3, rtol=0)


def test_expert_shards_split_the_expert_width(tiny) -> None:
    arch, _, path = tiny
    config = load_config(resolve_model(str(path)))
    shard = ModelShard.of(config, TPGroup(1, 2))
    assert shard.split_of("layers.0.mlp.experts.3.gate_proj.weight") == (0, 32, 64)
    assert shard.split_of("layers.0.mlp.experts.3.down_proj.weight") == (1, 32, 64)
    assert shard.split_of("layers.0.mlp.gate.weight") is None  # the router: replicated
    if arch == "qwen3_moe":  # the dense layer splits its own width
        assert shard.split_of("layers.1.mlp.up_proj.weight") == (0, 96, 192)
    check_tensor_parallel_size(config, 2, True)
    with pytest.raises(ValueError, match="experts' down projection"):  # 48 of each expert's 96 per rank
        check_tensor_parallel_size(dataclasses.replace(config, moe_intermediate_size=96), 2, True)

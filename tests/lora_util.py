"""The tiny llama and the LoRA adapters of the ``test_lora_end_to_end*`` modules: a random llama
checkpoint with SmolLM2's tokenizer (``base``), adapters made on it with ``peft``, B randomized
so that they change the outputs (``adapters``), and a float32 ``LLM`` serving them (``llm``);
each fixture is built once per module that imports it.

Test modules import from here, never from one another.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.models.loader import load_tokenizer, resolve_model
from tests.models_util import randomize_vectors, shared_prefix_prompts

MAX_TOKENS = 12
_, PROMPTS = shared_prefix_prompts(11, 20, (6, 7, 13))
# head_dim 64: decode steps without adapters run the one-call native decoder.
LLAMA = dict(
    vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_theta=1e4,
)
ADAPTERS = {
    "all": LoraConfig(
        r=8, lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "qv_rslora": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp_o": LoraConfig(
        r=16, lora_alpha=8, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 6}, alpha_pattern={"down_proj": 12},
    ),
}

# Special tokens and one-letter contents only: SmolLM2's own template's words lie outside the
# test model's 256-token vocabulary.
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_start|>"


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    """Greedy sampling of ``max_tokens`` tokens, EOS ignored, with each token's logprob."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.LlamaForCausalLM, Path]:
    """(HF model, its checkpoint folder with SmolLM2's tokenizer)."""
    path = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    randomize_vectors(hf)
    hf.save_pretrained(path)
    load_tokenizer(resolve_model("smollm2")).save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Name -> (PEFT adapter folder, transformers model with the adapter merged)."""
    hf, _ = base
    out = {}
    for i, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = get_peft_model(copy.deepcopy(hf), copy.deepcopy(config))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:  # peft starts B at zero: the adapter would change nothing
                    p.normal_(0.0, 0.3)
        path = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(path)
        out[name] = (path, model.merge_and_unload().eval())
    return out


def adapter_request(adapters, name: str) -> LoRARequest:
    """The request for adapter ``name`` of the ``adapters`` fixture; its id is its place in ``ADAPTERS``."""
    return LoRARequest(name, list(ADAPTERS).index(name) + 1, str(adapters[name][0]))


@pytest.fixture(scope="module")
def llm(base):
    """A float32 ``LLM`` on ``base`` with LoRA on (up to 4 adapters of rank <= 16), in 16-token steps."""
    _, path = base
    engine = LLM(
        model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, block_size=8,
        max_num_batched_tokens=16, enable_lora=True, max_loras=4, max_lora_rank=16,
    )
    yield engine
    engine.shutdown()

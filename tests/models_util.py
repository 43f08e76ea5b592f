"""Tiny random models shared by the model tests: transformers models built here, saved as GGUF
files the way llama.cpp's converter writes them, and our logits for a prompt through a paged
KV cache. No network: every weight is drawn from torch's global generator (seed it first).

Test modules import from here, never from one another.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.kv_cache_groups import kv_cache_groups
from pagedllm.kernels import library
from pagedllm.worker.kv_cache import allocate_kv_caches, build_attention_metadata
from tests.utils import pool_is_whole, random_gguf_blocks

PREFILL_BLOCK_SIZE = 16
GEMMA3_WINDOW = 5  # the tiny Gemma 3's sliding window: shorter than the tests' requests
# The tiny dense decoders' sizes (the vocabulary is SmolLM2's first 256 ids): head_dim 32.
DENSE_COMMON = dict(
    vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)


def save_checkpoint(hf: torch.nn.Module, path: Path, tokenizer_dir: Path) -> None:
    """``hf.save_pretrained(path)`` with the tokenizer files of ``tokenizer_dir`` beside it."""
    hf.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())


def edit_config(path: Path, **changes) -> None:
    """Set top-level fields of the checkpoint's config.json."""
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))


@torch.inference_mode()
def prefill_logits(model: torch.nn.Module, config: ModelConfig, ids: list[int]) -> torch.Tensor:
    """Our logits ``[len(ids), vocab]`` for every position of one prompt, prefilled in one step
    through a paged KV cache (float32, one group of blocks per KV cache group)."""
    groups = kv_cache_groups(config)
    n = -(-len(ids) // PREFILL_BLOCK_SIZE)  # blocks per group, each group its own ids
    kv_caches = allocate_kv_caches(
        KVCacheConfig.for_model(config, n * len(groups), PREFILL_BLOCK_SIZE, torch.float32)
    )
    tables = [[list(range(g * n, (g + 1) * n)) for g in range(len(groups))]]
    meta = build_attention_metadata(groups, config.num_layers, [len(ids)], [len(ids)], tables, PREFILL_BLOCK_SIZE)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), kv_caches, meta))


def randomize_vectors(model: torch.nn.Module, hidden: int | None = None) -> None:
    """transformers zero-inits biases and unit-inits norms: make them count. Every 1-D
    parameter gets N(1, 0.2) where it has ``hidden`` elements (or always, ``hidden`` None),
    N(0, 0.2) otherwise."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(1.0 if hidden is None or p.shape[0] == hidden else 0.0, 0.2)


def tiny_llama(**kwargs) -> transformers.LlamaForCausalLM:
    """A random llama of the given ``LlamaConfig`` sizes, its norms randomized."""
    config = transformers.LlamaConfig(
        max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **kwargs
    )
    model = transformers.LlamaForCausalLM(config).eval()
    randomize_vectors(model, config.hidden_size)
    return model


def tiny_gemma3(
    vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 96, num_attention_heads: int = 4,
    final_logit_softcapping: float | None = None,
) -> transformers.Gemma3ForCausalLM:
    """A random 6-layer Gemma 3 (one global layer, five sliding ones of ``GEMMA3_WINDOW``
    tokens), 1 KV head of size 64, eager attention, its norms randomized."""
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=6,
        num_attention_heads=num_attention_heads, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=48,
        max_position_embeddings=256, sliding_window=GEMMA3_WINDOW, rms_norm_eps=1e-6,
        final_logit_softcapping=final_logit_softcapping,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        attn_implementation="eager",
    )
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # norms init to 0 (i.e. 1 + 0): make them count
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.3)
    return model


def gemma3_config(c: transformers.Gemma3TextConfig) -> ModelConfig:
    """Our ``ModelConfig`` of a transformers Gemma 3 text config (tied embeddings; no logit
    soft-capping: set ``final_logit_softcapping`` where the test wants it)."""
    return ModelConfig(
        architecture="gemma3", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rope_theta=c.rope_parameters["full_attention"]["rope_theta"], rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
        layer_types=list(c.layer_types), sliding_window=c.sliding_window,
        rope_local_theta=c.rope_parameters["sliding_attention"]["rope_theta"],
        query_pre_attn_scalar=c.query_pre_attn_scalar,
    )


# --- GGUF files as llama.cpp's convert_hf_to_gguf.py writes them ----------------------------

# HF module names -> llama.cpp's tensor names in a block (blk.N.<name>.weight).
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",  # qwen3
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3, fused as stored
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
}
_GGUF_TOP_LEVEL = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# GGUF types of write_q4_gguf's matrices: the embedding Q8_0, every other one Q4_1.
_Q4_TYPES = {"token_embd": gguf.GGMLQuantizationType.Q8_0}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Types gguf.quants quantizes (the K-quants it only dequantizes).
_QUANTIZABLE = {gguf.GGMLQuantizationType[t] for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")}


def random_weight_blocks(
    qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], std: float = 0.1, seed: int = 0
) -> tuple[np.ndarray, torch.Tensor]:
    """GGUF blocks of ``qtype`` for a random weight of ``shape`` (rows of ``shape[-1]``, any
    leading dims, a 3-D expert stack too), weights of std about ``std``: gguf.quants' quantization
    of normal weights where it has one, else random blocks (``random_gguf_blocks``, their d
    scaled to the std). Returns (blocks [*shape[:-1], row bytes] uint8, gguf.quants'
    dequantization of them [*shape] float32: the file's exact weights)."""
    rows, k = math.prod(shape[:-1]), shape[-1]

    def values(blocks: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).view(shape)

    if qtype in _QUANTIZABLE:
        gen = torch.Generator().manual_seed(seed)
        blocks = gguf.quants.quantize((torch.randn(rows, k, generator=gen) * std).numpy(), qtype)
    else:
        unit = values(random_gguf_blocks(qtype, rows, k, seed).numpy()).std().item()
        blocks = random_gguf_blocks(qtype, rows, k, seed, scale=std / unit).numpy()
    return blocks.reshape(*shape[:-1], -1), values(blocks)


def stored_weights(
    hf: torch.nn.Module, types: dict[str, gguf.GGMLQuantizationType], std: float = 0.1
) -> dict[str, tuple[gguf.GGMLQuantizationType, np.ndarray]]:
    """Random GGUF blocks (``random_weight_blocks``) for the HF model's 2-D parameters named in
    ``types``, each parameter set to their dequantization; ``write_gguf``'s ``blocks``."""
    blocks = {}
    with torch.no_grad():
        for i, (name, qtype) in enumerate(types.items()):
            param = hf.get_parameter(name)
            stored, values = random_weight_blocks(qtype, tuple(param.shape), std, seed=i)
            blocks[name] = (qtype, stored)
            param.copy_(values)
    return blocks


def shared_prefix_prompts(seed: int, shared: int, lens: tuple[int, int, int]) -> tuple[list[int], list[list[int]]]:
    """Random token ids in [3, 256) (the tiny test vocabularies), drawn from ``seed``: a prefix of
    ``shared`` tokens, and three prompts: one of ``lens[0]`` tokens, then two that start with the
    prefix and go on for ``lens[1]`` and ``lens[2]`` more (a prefix-cache hit for the third)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 256, (shared,), generator=gen).tolist()
    first = torch.randint(3, 256, (lens[0],), generator=gen).tolist()
    return prefix, [first] + [prefix + torch.randint(3, 256, (n,), generator=gen).tolist() for n in lens[1:]]


def gguf_writer(path: Path, arch: str, c: transformers.PretrainedConfig) -> gguf.GGUFWriter:
    """A GGUF writer for ``arch`` holding the metadata every decoder's file has, from the HF
    config ``c`` (eos id 2); the caller adds its architecture's own keys and the tensors."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_eos_token_id(2)
    return writer


def finish_gguf(writer: gguf.GGUFWriter) -> None:
    """Write the header, metadata and tensors added to ``writer`` and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_greedy_matches(hf: torch.nn.Module, prompt: list[int], ours, max_tokens: int) -> None:
    """Our greedy ``CompletionOutput`` (``ours``, with logprobs) equals transformers' ``generate``
    of ``max_tokens`` tokens until the first near-tie (top-2 logprobs within 1e-3), logprobs
    within 1e-3 up to it."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
        )
    ref_tokens = ref.sequences[0, len(prompt) :].tolist()
    ref_logprobs = [step[0].float().log_softmax(-1) for step in ref.logits]
    assert len(set(ref_tokens)) > 1  # weights large enough that the tokens vary
    for i, (a, b) in enumerate(zip(ours.token_ids, ref_tokens, strict=True)):
        if a != b:  # allowed only at a near-tie, and then the rest may differ
            top2 = ref_logprobs[i].topk(2).values
            assert (top2[0] - top2[1]).item() < 1e-3, f"diverged at {i}"
            return
        assert math.isclose(ours.logprobs[i][a].logprob, ref_logprobs[i][a].item(), abs_tol=1e-3), i


def assert_greedy_through_chunks_and_prefix_hits(path: Path, hf: torch.nn.Module, prompts: list[list[int]],
                                                 max_tokens: int, decoder: type | None = None) -> None:
    """``path``'s model in 16-token chunks of 8-token blocks: ``prompts[:2]``, then the rest
    (hitting their cached blocks: >= 16 tokens), greedy as transformers' (``assert_greedy_matches``),
    then all again with the same tokens; the pool whole after; ``decoder``: the native decoder's type."""
    llm = LLM(
        model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, block_size=8,
        max_num_batched_tokens=16, enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    first = llm.generate(prompts[:2], params, use_tqdm=False)
    hits = llm.engine.core.kv_cache.prefix_hits
    first += llm.generate(prompts[2:], params, use_tqdm=False)
    assert llm.engine.core.kv_cache.prefix_hits - hits >= 16  # the shared 24 tokens' full blocks
    if decoder is not None and library.available():
        assert isinstance(llm.engine.core.executor.runner.model.native_decoder, decoder)
    for prompt, out in zip(prompts, first, strict=True):
        assert_greedy_matches(hf, prompt, out.outputs[0], max_tokens)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert pool_is_whole(llm)
    llm.shutdown()


def write_gguf(
    path: Path,
    hf: torch.nn.Module,
    tokens: list[str] | None = None,
    blocks: dict[str, tuple[gguf.GGMLQuantizationType, np.ndarray]] | None = None,
) -> None:
    """Save an HF llama/qwen2/qwen3/phi3 model as a GGUF the way llama.cpp's converter would
    (eos id 2; ``tokens`` as the token list when given): F32 tensors, except the parameters
    named in ``blocks`` (HF names: (type, blocks [rows, row bytes] in HF's row order), e.g.
    ``stored_weights``'), written as those blocks."""
    c = hf.config
    writer = gguf_writer(path, c.model_type, c)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim != c.hidden_size // c.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if c.model_type == "phi3":  # its converter writes the rotated dims (partial rotary embeddings)
        writer.add_rope_dimension_count(int(head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0)))
        if c.sliding_window:
            writer.add_sliding_window(c.sliding_window)
    if tokens:
        writer.add_token_list(tokens)
    _write_rope_scaling(writer, c.rope_parameters, head_dim, c.max_position_embeddings)
    for name, tensor in hf.state_dict().items():
        qtype, w = (blocks or {}).get(name, (None, tensor.numpy()))
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, _, suffix = rest.rpartition(".")
            if c.model_type == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if "q_proj" in module else c.num_key_value_heads
                w = llama_cpp_permute(w, heads)
            gguf_name = f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"
        else:
            gguf_name = _GGUF_TOP_LEVEL[name]
            if gguf_name == "output.weight" and c.tie_word_embeddings:
                continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(w), raw_dtype=qtype)
    finish_gguf(writer)


def _write_rope_scaling(writer: gguf.GGUFWriter, rope: dict, head_dim: int, context: int) -> None:
    """RoPE scaling as llama.cpp's converter writes it: linear and yarn as ``rope.scaling.*``
    metadata, llama3 as a ``rope_freqs.weight`` tensor of frequency factors (LlamaModel's
    ``generate_extra_tensors``), Phi-3's longrope as its two factor tensors, the original
    context length and the attention factor (Phi3MiniModel's)."""
    rope_type = rope.get("rope_type", "default")
    if rope_type == "longrope":
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = context / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    if rope_type in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_type))
        writer.add_rope_scaling_factor(rope["factor"])
        if rope_type == "yarn":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope_type == "llama3":
        freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_context = rope["original_max_position_embeddings"]
        factors = []
        for freq in freqs.tolist():
            wavelen = 2 * math.pi / freq
            if wavelen < old_context / high:
                factors.append(1.0)
            elif wavelen > old_context / low:
                factors.append(factor)
            else:
                smooth = (old_context / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))


def write_q4_gguf(path: Path, hf: torch.nn.Module, q4_0: tuple[str, ...] = ()) -> None:
    """``write_gguf`` with every matrix quantized by gguf's reference quantizer: the embedding
    Q8_0, the projections (and an untied output) Q4_1, those whose name ends in one of ``q4_0``
    (e.g. ``"ffn_up.weight"``) Q4_0; vectors stay F32."""
    add_tensor = gguf.GGUFWriter.add_tensor

    def add_quantized(self, name: str, tensor: np.ndarray, **kwargs) -> None:
        if tensor.ndim != 2:
            return add_tensor(self, name, tensor, **kwargs)
        default = gguf.GGMLQuantizationType.Q4_0 if name.endswith(q4_0) else gguf.GGMLQuantizationType.Q4_1
        qtype = _Q4_TYPES.get(name.removesuffix(".weight"), default)
        return add_tensor(self, name, gguf.quants.quantize(tensor.astype(np.float32), qtype), raw_dtype=qtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_quantized)
        write_gguf(path, hf)


# --- the tiny mixture-of-experts models of the test_moe_* modules, and their ``tiny`` fixture ---

MOE_WINDOW = 12  # Mixtral's: shorter than the longer prompts
MOE_SHARED, MOE_PROMPTS = shared_prefix_prompts(7, 24, (5, 9, 17))
_MOE_COMMON = dict(
    vocab_size=256, hidden_size=128, num_hidden_layers=3, max_position_embeddings=256, rms_norm_eps=1e-6,
    initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2,
)
# Head size 64 (the native decode attention's smallest): the one-call decoder runs the decode
# steps. Qwen3-MoE: 8 experts, the top-2 weights left unnormalized, layer 1 dense (its
# ``mlp_only_layers``). Mixtral: 4 experts, a sliding window on every layer.
_MOE_CONFIG_ARGS = {
    "qwen3_moe": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=192, moe_intermediate_size=64,
        num_experts=8, norm_topk_prob=False, mlp_only_layers=[1], rope_theta=1e6,
    ),
    "mixtral": dict(
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, num_local_experts=4,
        sliding_window=MOE_WINDOW, rope_theta=1e4,
    ),
}
_MOE_CONFIG_CLASSES = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}
# arch -> a function of config changes giving the HF config: the sizes above, then the changes.
MOE_CONFIGS = {
    arch: lambda arch=arch, **changes: _MOE_CONFIG_CLASSES[arch](**(_MOE_COMMON | _MOE_CONFIG_ARGS[arch] | changes))
    for arch in _MOE_CONFIG_ARGS
}
MOE_HF_CLASSES = {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "mixtral": transformers.MixtralForCausalLM}


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """(architecture, HF model, checkpoint directory): a tiny random MoE model per architecture,
    built once per module that imports this fixture (~0.05 s each)."""
    arch, path = request.param, tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf = MOE_HF_CLASSES[arch](MOE_CONFIGS[arch]()).eval()
    randomize_vectors(hf)  # transformers unit-inits the norms (q/k norms included)
    save_checkpoint(hf, path, tokenizer_dir)
    return arch, hf, path

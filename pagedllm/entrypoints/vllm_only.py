"""vLLM settings pagedllm has no use for, and what to do instead: said when one is refused, as
a command-line flag (``cli``) or as a keyword of ``LLM(...)`` (``llm``), in the same words."""

from __future__ import annotations

# Setting (the LLM keyword; the flag is ``--`` and dashes) -> what to do here instead.
VLLM_ONLY = {
    "gpu_memory_utilization": "the KV cache is sized in bytes here, by kv_cache_memory / --kv-cache-memory (e.g. 4GiB)",
    "trust_remote_code": "no code from a checkpoint is ever run here (GGUF, or config.json + safetensors): leave it out",
    "load_format": "the format follows the model path: a .gguf file, or a directory of safetensors",
    "revision": "models are local paths or installed aliases here: nothing is downloaded",
    "guided_decoding_backend": "structured outputs always run on llguidance here",
    "disable_log_requests": "serve's --disable-access-log drops the log line per request",
    "enforce_eager": "nothing is captured or compiled here (native kernels, one call per step): leave it out",
    "swap_space": "a preempted request is recomputed here, never swapped: leave it out",
    "tokenizer": "the tokenizer comes with the model (a GGUF's vocabulary, or the folder's tokenizer files)",
    "enable_chunked_prefill": "prefill is always chunked here, by the step's token budget: max_num_batched_tokens "
    "/ --max-num-batched-tokens",
}


def hint(setting: str) -> str:
    """``"; <setting>: <what to do instead>"`` for a vLLM-only setting (flag or keyword), else ``""``."""
    key = setting.split("=", 1)[0].lstrip("-").replace("-", "_")
    return f"; {setting.split('=', 1)[0]}: {VLLM_ONLY[key]}" if key in VLLM_ONLY else ""

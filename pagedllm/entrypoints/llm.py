"""The offline batch API, in vLLM's shape: ``LLM(...).generate(prompts, sampling_params)``. Its
arguments are checked and made into the engine's inputs by ``llm_inputs``; this module runs them."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from pagedllm.config import DEFAULT_MODEL, EngineConfig
from pagedllm.config_values import parse_memory
from pagedllm.platforms.cpu import dtype_settings, lora_dtype_setting
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import PromptType
from pagedllm.entrypoints.beam_search import BeamSearchOutput, beam_search
from pagedllm.entrypoints.llm_inputs import Message, check_one_adapter_per_id, per_prompt, prompt_list, render_chats
from pagedllm.entrypoints.vllm_only import hint
from pagedllm.live_view.trace import write_trace
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.errors import InvalidParamError
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    """An engine for offline batched generation.

    Args:
        model: a .gguf path, an HF checkpoint directory, or an installed model alias.
        dtype: compute dtype: "auto" (float32 activations around w8a8 linear layers, the
            lm_head included, float32 ones on scalar kernels, and a bfloat16 K/V cache;
            without native kernels float32 activations and K/V around weight-only int8 linear
            layers and lm_head; see
            ``platforms.cpu.dtype_settings``),
            "float32" (float32 only: exact, outputs independent of batching), "bfloat16" or
            "float16". ``kv_cache_dtype="float32"`` (or another dtype, or "int8", "fp8": the
            8-bit caches) overrides the K/V cache's; ``lora_dtype`` ("auto": bfloat16 with dtype
            "auto" on the native kernels, else the model's; "float32"; "bfloat16") the LoRA
            adapters' (``platforms.cpu.lora_dtype_setting``).
        max_model_len: longest prompt + output; default the model's context, at most 8192.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget per step.
        kv_cache_memory: KV cache size: bytes, or a string such as "2GiB".
        speculative_config: speculative decoding, as a dict or JSON string in vLLM's shape,
            e.g. ``{"method": "ngram", "num_speculative_tokens": 4}`` or
            ``{"method": "draft_model", "model": "...", "num_speculative_tokens": 4}``; None: off.
        quantization: quantization of the linear layers: "none", "int8" (per output channel)
            or "int4" (groups of ``quantization_group_size``: 32, 64, 128), weight-only; "w8a8"
            (int8 weights and activations); "w4a8" (4-bit weights, int8 activations, a w8a8
            lm_head); None: as ``dtype`` decides. ``quantize_lm_head=True``
            quantizes the logits matmul too.
        trace: a file path: record every engine step (the live view's records) and, after each
            ``generate``/``chat``, write them there as Chrome Trace Event JSON (Perfetto,
            chrome://tracing); the last ``live_view_steps`` steps (default 4096) are kept.
        **kwargs: any other ``EngineConfig`` field (block_size, enable_prefix_caching, ...),
            taken as given: one ``dtype`` also sets (``quantize_lm_head``, ``requantize_4bit``)
            keeps the caller's value; ``live_view=True`` records the steps as ``trace`` does.

    Raises:
        ValueError: for an unknown model, an unsupported architecture or a bad setting.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
        kv_cache_memory: int | str = "2GiB",
        speculative_config: dict[str, Any] | str | None = None,
        quantization: str | None = None,
        trace: str | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(EngineConfig)} - {"kv_cache_dtype"})
        if unknown:  # vLLM's keywords that have no use here say what to do instead
            raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(unknown)}" + "".join(map(hint, unknown)))
        kwargs["lora_dtype"] = lora_dtype_setting(dtype, kwargs.get("lora_dtype", "auto"))
        settings = dtype_settings(dtype, kwargs.pop("kv_cache_dtype", "auto"), quantization)
        config = EngineConfig(
            model=model,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory=parse_memory(kv_cache_memory),
            speculative_config=speculative_config,
            live_view=kwargs.pop("live_view", False) or trace is not None,
            **(settings | kwargs),  # a keyword given wins over what dtype implies
        )
        self.trace = trace
        self.engine = LLMEngine(config)
        self._counter = itertools.count()
        # One call steps the engine at a time: another thread's waits its turn; a call made
        # inside a running one (from a use_tqdm bar's callback) is refused (_generate).
        self._lock = threading.Lock()
        self._running_in: int | None = None  # the thread whose call holds _lock

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any) and hand back this process's cores; idempotent.

        With ``tensor_parallel_size`` > 1 this process is rank 0, pinned to its share of the cores
        until then.
        """
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache's cached blocks, as vLLM's: later prompts are computed anew
        (a benchmark's cold start). False, and nothing dropped, while a request holds blocks
        (never between ``generate`` calls)."""
        return self.engine.core.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no ``sampling_params``, as vLLM's:
        the sampling defaults the model's ``generation_config.json`` recommends (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens;
        ``ModelConfig.sampling_defaults``) over
        ``SamplingParams()``'s; a fresh struct each call."""
        return SamplingParams(**self.engine.core.model_config.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; return outputs in input order.

        Args:
            prompts: a prompt or a list of them; a prompt is a string, a token-id list, or
                vLLM's dict of either: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``.
            sampling_params: one for all prompts, or a list of one per prompt; None:
                ``get_default_sampling_params()`` (the model's generation_config.json
                defaults, else ``SamplingParams()``'s, as vLLM).
            use_tqdm: show a progress bar (True), none (False), or a callable that makes the
                bar, as vLLM's: called with tqdm's arguments (``total``, ``desc``, ...), e.g.
                ``functools.partial(tqdm, leave=False)``.
            lora_request: the LoRA adapter of all prompts, or a list of one (or None: the base
                model) per prompt; needs ``enable_lora=True``. An id names one adapter (one
                name and path) within the list.

        Raises:
            ValueError: if any prompt or parameter is invalid, a list of ``sampling_params``
                or ``lora_request`` is not one per prompt, or one id of ``lora_request`` names
                two adapters, or ``use_tqdm`` is neither a bool nor a callable (an
                ``InvalidParamError`` naming the field); nothing is queued then, so no earlier
                prompt of the list runs.
            KeyboardInterrupt, or an error of an engine step or of ``use_tqdm``'s bar:
                propagated after this call's unfinished requests are aborted, so the engine
                stays usable.
            RuntimeError: called from inside a running call of this ``LLM`` (its bar's
                callback). Calls from other threads are not refused: they run one at a time.
            OSError: with ``trace``, if the trace file cannot be written (after generating).
        """
        return self._generate(prompt_list(prompts), sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (``entrypoints.beam_search``): for each prompt (as ``generate``
        takes them) its ``params.beam_width`` best beams, best first, each with its tokens
        (prompt included), per-step candidate logprobs, cumulative logprob and generated text.

        Raises:
            ValueError: ``params`` not a ``BeamSearchParams``, or any prompt or ``lora_request``
                ``generate`` refuses (an ``InvalidParamError`` naming the field); nothing runs then.
        """
        return beam_search(self.engine.processor, self.generate, self.get_tokenizer(), prompts, params, lora_request,
                           use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate. Contents are
        text: a content that spells a special token gets no special token from it
        (``chat_template.chat_prompt``). The arguments are vLLM's, in vLLM's order (positional
        calls written for vLLM's ``LLM.chat`` mean the same here).

        Args:
            messages: one conversation (a list of {"role", "content"} dicts) or a list of them;
                a content is a str, a list of {"type": "text", "text": str} parts or None, given
                to the template as vLLM does (``chat_template.chat_prompt``).
            chat_template: a Jinja template to use instead of the model's (its text).
            chat_template_content_format: how a content reaches the template, as vLLM's:
                "string" (a list of text parts joined by newlines into one str), "openai" (the
                list of parts, a str content as one text part) or "auto" (the template's own
                way: "openai" when it loops over a message's content, else "string").
            use_tqdm: as ``generate``'s.
            lora_request: as ``generate``'s, one for all conversations or one per conversation.
            tools: OpenAI-style tool definitions ({"type": "function", "function": {...}}) given
                to the template as its ``tools``, as vLLM's ``LLM.chat`` does: a template with a
                tool section (Qwen2.5's) lists them in the prompt, one without ignores them.
            continue_final_message: end the prompt inside the conversation's last message (its
                turn left open), so that the output continues it (vLLM's; not with
                ``add_generation_prompt``).
            chat_template_kwargs: more variables for the template (vLLM's; e.g. Qwen3's
                ``enable_thinking``); the arguments above are set by name, not here.

        Raises:
            ValueError: ``messages`` that are not such a list, a message that is not such a
                dict, text that is not Unicode scalar values (lone surrogates), a conversation
                the chat template refuses to render (as vLLM, the template's error as a
                ValueError), ``tools`` that are not a list of dicts, ``add_generation_prompt`` or
                ``continue_final_message`` not a bool, ``continue_final_message`` with
                ``add_generation_prompt``, ``chat_template_kwargs`` that are not a dict of
                names or that name an argument above, or any error ``generate`` raises;
                nothing is run then. Each is an ``InvalidParamError`` naming the field
                (``messages.0.content``).
        """
        rendered = render_chats(
            self.engine.tokenizer, messages, chat_template=chat_template, content_format=chat_template_content_format,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self._generate(
            [ids for _, ids in rendered], sampling_params, use_tqdm, [text for text, _ in rendered], lora_request
        )

    def _generate(
        self,
        prompts: Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool | Callable[..., tqdm],
        texts: Sequence[str] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``generate`` for a list of prompts; ``texts``: the text each token-id prompt was
        rendered from (a chat template's), for the outputs' ``prompt``. Calls from several
        threads run one after another (the engine steps for one call at a time).

        Raises:
            RuntimeError: called while a call of this thread is running (from inside its
                ``use_tqdm`` bar): it would take that call's outputs.
        """
        if self._running_in == threading.get_ident():
            raise RuntimeError("LLM.generate (or chat) called inside a running call of the same LLM (from its use_tqdm "
                               "bar): it would take that call's outputs; call it after the first one returns")
        with self._lock:
            self._running_in = threading.get_ident()
            try:
                return self._generate_locked(prompts, sampling_params, use_tqdm, texts, lora_request)
            finally:
                self._running_in = None

    def _generate_locked(
        self,
        prompts: Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool | Callable[..., tqdm],
        texts: Sequence[str] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[RequestOutput]:
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise InvalidParamError(
                "use_tqdm", f"use_tqdm must be a bool or a callable that makes a tqdm bar, got {type(use_tqdm).__name__}"
            )
        default = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params = per_prompt(default, SamplingParams, "sampling_params", len(prompts))
        loras = per_prompt(lora_request, LoRARequest, "lora_request", len(prompts))
        check_one_adapter_per_id(loras)
        # Validate everything before queueing anything.
        ids = [str(next(self._counter)) for _ in prompts]
        prepared = [
            self.engine.prepare(i, p, sp, lora_request=lr) for i, p, sp, lr in zip(ids, prompts, params, loras, strict=True)
        ]
        for k, (request_id, (text, core_requests)) in enumerate(zip(ids, prepared)):
            self.engine.submit(request_id, text if texts is None else texts[k], core_requests)
        return self._run(ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        """Step the engine until it is idle; the outputs of ``request_ids``, in that order.

        Whatever interrupts the loop (Ctrl-C, an error of the step) aborts every request of
        ``request_ids`` not yet finished before it propagates, so the engine is left idle with
        its blocks free: a later ``generate`` neither runs them nor trips over their state.
        """
        done: dict[str, RequestOutput] = {}
        # vLLM's use_tqdm may be the bar's maker (functools.partial(tqdm, leave=False)), called with
        # vLLM's arguments; a bool picks tqdm's own bar, shown or not.
        bar_args = dict(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        bar = None
        start, num_out = time.perf_counter(), 0
        try:  # the bar's maker too: a maker that raises leaves nothing queued either
            bar = tqdm(**bar_args, disable=not use_tqdm) if isinstance(use_tqdm, bool) else use_tqdm(**bar_args)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        num_out += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output: {num_out / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            for request_id in request_ids:
                if request_id not in done:
                    self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        if self.trace is not None:
            write_trace(self.engine.live_view, self.trace)
        return [done[i] for i in request_ids]

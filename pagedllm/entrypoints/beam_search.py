"""vLLM's offline beam search, ``LLM.beam_search``: each step asks the engine for one token of
every live beam with its ``2 * beam_width`` most likely next tokens (the prefix cache keeps
each step's prompt, the beam so far, from being recomputed), extends the beams by those
candidates and keeps the ``beam_width`` best of each prompt's; a beam that ends in EOS is
finished. Scores are vLLM's ``get_beam_search_score``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from pagedllm.engine.processor import Processor
from pagedllm.entrypoints.llm_inputs import check_one_adapter_per_id, per_prompt, prompt_list
from pagedllm.errors import InvalidParamError
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: ``tokens`` are the prompt's and the generated ones; ``logprobs``
    the candidates' of each generated position; ``text`` the generated tokens' text (without
    a final EOS unless ``include_stop_str_in_output``); ``finish_reason`` "stop" (EOS) or
    "length" (max_tokens, or max_model_len reached)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first (at most ``beam_width``)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_ids: set[int], length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: ``cum_logprob / len ** length_penalty``, the length
    being the whole sequence's (prompt included) less a final EOS."""
    length = len(tokens) - (1 if tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length**length_penalty)


def beam_search(
    processor: Processor,
    generate: Callable[..., list[RequestOutput]],
    tokenizer: Any,
    prompts: Any,
    params: BeamSearchParams,
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    use_tqdm: bool = False,
) -> list[BeamSearchOutput]:
    """``LLM.beam_search`` on its engine's ``processor``, its ``generate`` and ``tokenizer``:
    the best beams of each prompt, in input order.

    Raises:
        InvalidParamError: ``params`` not a ``BeamSearchParams``, or a prompt or
            ``lora_request`` ``LLM.generate`` refuses (checked before any step runs).
    """
    if not isinstance(params, BeamSearchParams):
        raise InvalidParamError("params", f"params must be a BeamSearchParams, got {type(params).__name__}")
    prompts = prompt_list(prompts)
    loras = per_prompt(lora_request, LoRARequest, "lora_request", len(prompts))
    check_one_adapter_per_id(loras)
    eos = set() if params.ignore_eos else set(processor.eos_token_ids)
    step = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
    prompt_ids, live, done = [], [], []
    for prompt, lora in zip(prompts, loras, strict=True):
        _, ids = processor.tokenize(prompt)
        processor.process("beam-check", ids, step, lora_request=lora)  # refuse a bad prompt before any step
        prompt_ids.append(ids)
        live.append([BeamSearchSequence(list(ids), [], lora_request=lora)])
        done.append([])

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
        for beams, finished in zip(live, done, strict=True):  # a full context ends its beam
            finished += [b for b in beams if len(b.tokens) >= processor.max_model_len]
            beams[:] = [b for b in beams if len(b.tokens) < processor.max_model_len]
        batch = [beam for beams in live for beam in beams]
        if not batch:
            break
        outputs = generate([{"prompt_token_ids": b.tokens} for b in batch], step, use_tqdm=False,
                           lora_request=[b.lora_request for b in batch])
        results = iter(outputs)
        for k, beams in enumerate(live):
            candidates = []
            for beam in beams:
                top = next(results).outputs[0].logprobs[0]
                for token, logprob in top.items():
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                             beam.cum_logprob + logprob.logprob, lora_request=beam.lora_request)
                    (done[k] if token in eos else candidates).append(new)
            live[k] = sorted(candidates, key=score, reverse=True)[: params.beam_width]
    results = []
    for ids, beams, finished in zip(prompt_ids, live, done, strict=True):
        best = sorted(finished + beams, key=score, reverse=True)[: params.beam_width]
        for beam in best:
            stopped = beam.tokens[-1] in eos and len(beam.tokens) > len(ids)
            beam.finish_reason = "stop" if stopped else "length"
            end = len(beam.tokens) - (1 if stopped and not params.include_stop_str_in_output else 0)
            beam.text = tokenizer.decode(beam.tokens[len(ids):end])
        results.append(BeamSearchOutput(best))
    return results

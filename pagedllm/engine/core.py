"""The engine core: scheduler + KV cache + model runner, stepped one batch at a time.

It sees token ids only; tokenization, detokenization and stop strings live in the front
end. The same object runs in process (offline ``LLM``) or inside the engine-core process.
"""

from __future__ import annotations

import dataclasses
import json

import logging
import os
import time

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_config import create_kv_cache_config
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedllm.outputs import RequestError
from pagedllm.live_view.recorder import StepRecorder
from pagedllm.distributed.sharding import check_tensor_parallel_size
from pagedllm.executor.factory import create_executor
from pagedllm.kernels.attention import MAX_PREFILL_BLOCK
from pagedllm.models.loader import load_config, load_tokenizer, resolve_model
from pagedllm.models.safetensors_loader import sampling_defaults
from pagedllm.spec_decode.proposer import Proposer
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("pagedllm")

# A step loop with nothing to run but requests whose grammars compile waits this long at most
# for one to finish, instead of spinning.
_COMPILE_WAIT_S = 0.05

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


_statm: tuple[int, int] | None = None  # (pid, fd of its /proc/<pid>/statm)


def resident_memory_bytes() -> int:
    """This process's resident set size in bytes (Linux ``/proc``; 0 where it is unavailable).

    Read every step for the stats: the process's ``statm`` stays open and is re-read from
    offset 0 (an open per call cost more than the rest of the stats together); a forked child
    opens its own."""
    global _statm
    try:
        pid = os.getpid()
        if _statm is None or _statm[0] != pid:
            _statm = (pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


class EngineCore:
    """Loads the model and runs steps.

    Args:
        config: engine settings (model, dtype, cache budget, scheduler limits).
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        model_config = load_config(resolve_model(config.model))
        # Before any rank starts: a size the model cannot split is the user's error, named.
        check_tensor_parallel_size(model_config, config.tensor_parallel_size, config.quantization_config() is not None)
        kv = self.kv_config = create_kv_cache_config(config, model_config)
        self.num_blocks = kv.num_blocks
        self.max_model_len = kv.max_model_len
        logger.info(
            "KV cache: %d blocks of %d tokens x %d layers, %.2f %s in %s; %d group(s) with windows %s; "
            "longest request %d tokens",
            kv.num_blocks, kv.block_size, len(kv.groups[0].layers),
            *((kv.num_bytes / 1024**3, "GiB") if kv.num_bytes >= 1024**3 else (kv.num_bytes / 1024**2, "MiB")),
            kv.dtype, len(kv.groups),
            [g.window for g in kv.groups], kv.max_model_len,
        )
        if kv.block_size > MAX_PREFILL_BLOCK:
            logger.warning(
                "block_size %d: prefill attention runs in PyTorch, not the native kernel, above block size %d "
                "(slower prompts; lower --block-size)", kv.block_size, MAX_PREFILL_BLOCK,
            )
        self.kv_cache = KVCacheManager(kv.num_blocks, kv.block_size, config.enable_prefix_caching, kv.groups)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
            config.max_loras if config.enable_lora else None, config.long_prefill_token_threshold,
        )
        self.executor = create_executor(config, kv)
        self.model_config = self.executor.model_config
        if config.generation_config != "auto":  # vLLM's flag: SamplingParams' own defaults, or a folder's file's
            self.model_config = dataclasses.replace(self.model_config, sampling_defaults=_sampling_defaults(config))
        self.recorder = StepRecorder(self.kv_cache) if config.live_view else None
        self.proposer = self._build_proposer()
        self.structured = StructuredOutputManager(
            lambda: load_tokenizer(resolve_model(config.model)), model_config.vocab_size, model_config.eos_token_ids
        )

    def _build_proposer(self) -> Proposer | None:
        """The speculative decoding proposer of ``config.speculative_config``; None when off."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            from pagedllm.spec_decode.ngram_proposer import NgramProposer

            return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        from pagedllm.spec_decode.draft_proposer import DraftModelProposer

        # As many draft KV slots as target ones: every request the target holds can be drafted for.
        return DraftModelProposer(
            spec.model, spec.num_speculative_tokens, self.model_config.vocab_size,
            self.num_blocks, self.config.block_size, self.config.dtype, self.config.kv_dtype, self.max_model_len,
        )

    # -- requests ------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request (the front end has validated it); its grammar, if any, starts compiling."""
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_ids,
            self.max_model_len,
            cache_salt=req.cache_salt,
            arrival_time=req.arrival_time,
            lora_request=req.lora_request,
        )
        if req.sampling_params.structured_outputs is not None:
            request.structured_output = self.structured.request_state(req.sampling_params.structured_outputs)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the executor's other ranks; idempotent."""
        self.executor.shutdown()

    # -- one step ------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, update the requests; return what changed.

        A request that fails alone (while being scheduled, sampled or scored) is finished
        with reason "error", its blocks freed; the others carry on. Anything else that
        raises (the forward pass, out of memory) propagates: the core cannot go on.
        """
        recorder = self.recorder
        if recorder is not None:
            recorder.begin(self.scheduler)
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.failed and (compiling := self.scheduler.compiling):
            self.structured.wait([r.structured_output for r in compiling], _COMPILE_WAIT_S)
        entries = recorder.entries(sched) if recorder is not None else None
        sampled = None
        failed = list(sched.failed)
        outputs: list[EngineCoreOutput] = []
        if not sched.is_empty:
            result = self.executor.execute(sched)
            sampled = result.sampled
            failed += [(sched.scheduled[i].request.request_id, error) for i, error in result.errors.items()]
            self.scheduler.finish_requests([rid for rid, _ in failed], RequestStatus.FINISHED_ERROR)
            index = {id(s): i for i, s in enumerate(sched.scheduled)}
            updated = self.scheduler.update_from_output(sched, result.sampled)
            for s, new_tokens in updated:
                i = index[id(s)]
                request = s.request
                # A grammar that failed at a token hit a parser or lexer limit: the request's own error.
                grammar_error = None if request.structured_output is None else request.structured_output.error
                out = EngineCoreOutput(
                    request.request_id,
                    new_tokens,
                    request.status.finish_reason,
                    request.stop_reason,
                    # A stop inside an accepted run of drafts drops the tokens after it.
                    None if result.logprobs[i] is None else result.logprobs[i].first(len(new_tokens)),
                    result.prompt_logprobs[i],
                    max(request.num_cached_tokens, 0),
                    None if grammar_error is None else RequestError.of(grammar_error),
                )
                if not request.times_sent:
                    self._send_times(request, out)
                outputs.append(out)
            if self.proposer is not None:
                self._propose([s.request for s, new in updated if new and not s.request.is_finished])
            # Prompt logprobs of chunks that sampled nothing still have to reach the front end.
            for i, s in enumerate(sched.scheduled):
                if not result.sampled[i] and result.prompt_logprobs[i] is not None and i not in result.errors:
                    out = EngineCoreOutput(s.request.request_id, [], prompt_logprobs=result.prompt_logprobs[i])
                    if not s.request.times_sent:
                        self._send_times(s.request, out)
                    outputs.append(out)
        outputs += [EngineCoreOutput(rid, [], "error", error=error) for rid, error in failed]
        record = None
        if recorder is not None:
            record = recorder.finish(self.scheduler, self.kv_cache.usage, entries, sched, sampled)
        return EngineCoreOutputs(outputs, self.stats(), time.monotonic(), step=record)

    @staticmethod
    def _send_times(request: Request, out: EngineCoreOutput) -> None:
        """Put the request's queued and first-scheduled times on its first output (once per request)."""
        out.queued_time, out.scheduled_time = request.queued_time, request.scheduled_time
        request.times_sent = True

    def idle_outputs(self) -> EngineCoreOutputs:
        """Stats (and with the live view, the block operations) of a moment without a step: after aborts."""
        record = None if self.recorder is None else self.recorder.finish(self.scheduler, self.kv_cache.usage)
        return EngineCoreOutputs(stats=self.stats(), timestamp=time.monotonic(), step=record)

    def _propose(self, requests: list[Request]) -> None:
        """Drafts for the next step, from the tokens just added (none while the batch is large)."""
        limit = self.config.speculative_config.disable_by_batch_size
        if limit is None or len(self.scheduler.running) < limit:
            self.proposer.propose(requests)
            # Drafts the grammar forbids would only be rejected: cut them. A draft sampled from q
            # (spec_probs) is cut after the first forbidden one instead: its verification rejects
            # it with certainty (p is 0 there) and draws from max(p - q, 0), as the algorithm
            # must; drawing that position from p would skew the output toward the drafts' tokens.
            for r in requests:
                if r.structured_output is not None and r.spec_token_ids:
                    n = r.structured_output.num_valid(r.spec_token_ids)
                    if r.spec_probs is not None:
                        n = min(n + 1, len(r.spec_token_ids))
                        r.spec_probs = r.spec_probs[:n]
                    r.spec_token_ids = r.spec_token_ids[:n]
        self.proposer.remove_finished(self.scheduler.requests)

    def stats(self) -> SchedulerStats:
        spec = self.scheduler.spec_stats
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv_cache.prefix_queries,
            prefix_cache_hits=self.kv_cache.prefix_hits,
            resident_memory_bytes=resident_memory_bytes(),
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
        )


def _sampling_defaults(config: EngineConfig) -> dict[str, float | int]:
    """The sampling defaults ``config.generation_config`` names other than the checkpoint's:
    none for "vllm", else those of the folder's generation_config.json."""
    if config.generation_config == "vllm":
        return {}
    path = os.path.join(config.generation_config, "generation_config.json")
    with open(path, encoding="utf-8") as f:
        return sampling_defaults(json.load(f), path)

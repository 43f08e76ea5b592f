"""Front-end output processing: detokenize, apply stop strings, assemble RequestOutputs.

A user request with ``n`` samples is ``n`` engine-core requests ("{id}-{i}"); their outputs
are gathered here into one ``RequestOutput``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.engine.detokenizer import IncrementalDetokenizer, TokenBytes, token_shares, token_text
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs, TokenLogprobs
from pagedllm.sampling_params import SamplingParams


@dataclass
class SampleState:
    """One of the ``n`` samples of a request."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_token_ids: frozenset[int]  # tokens that end it (EOS unless ignore_eos, stop_token_ids)
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_param: str | None = None
    first_token_time: float | None = None  # this process's time.monotonic(), as ``RequestState.arrival_time``
    last_token_time: float | None = None
    # Its core's time.monotonic() (the core's outputs' times): queued and first scheduled there,
    # the step that completed its prefill (its first token, or the end of a prompt-only one) and
    # the step of its last token (that step again when it got none).
    queued_ts: float | None = None
    scheduled_ts: float | None = None
    num_cached_tokens: int | None = None  # its prompt's prefix-cache hit, once its prefill completed
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    final_delta: str = ""  # text released by the detokenizer's flush, not yet streamed


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    stream: bool  # emit deltas every step, else one cumulative output at the end
    arrival_time: float
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # With prompt_logprobs (and detokenize): each prompt token's share of the prompt's text
    # (``token_shares``), the string its entry gets, so that the prompt's tokens join to its text.
    prompt_texts: list[str] | None = None
    num_cached_tokens: int = 0
    lora_request: LoRARequest | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass
class FinishedSample:
    """What the per-request metrics take of one finished sample (one engine-core request).

    Times in seconds; an interval is None when the sample never reached one of its ends (aborted
    while waiting, failed before its first token): queue is queued to first scheduled, prefill
    first scheduled to first token, decode first to last token, inference first scheduled to
    last token (vLLM's intervals, a preemption's time inside the one it fell in).
    """

    finish_reason: str
    e2e_latency: float  # the request's arrival to this sample's end, in the front end
    num_prompt_tokens: int
    num_cached_tokens: int | None  # prompt tokens it found in the prefix cache; None: no prefill completed
    num_generation_tokens: int  # the tokens it got (its usage's completion_tokens)
    max_tokens: int | None  # its max_tokens parameter
    queue_time: float | None
    prefill_time: float | None
    decode_time: float | None
    inference_time: float | None


@dataclass
class FinishedRequest:
    """What the metrics take of a user request once all its samples have finished."""

    n: int
    max_num_generation_tokens: int  # the most tokens one of its samples got


@dataclass
class StepMetrics:
    """What the metrics take of the outputs handled since they last took them (one core step's,
    or an abort's): counts, and latencies in seconds."""

    num_outputs: int = 0  # engine-core outputs handled
    # Prompt tokens of the samples whose prefill completed (their first token, or the end of a
    # prompt-only one: max_tokens 0), prefix-cache hits included, each of n samples counting
    # its prompt (vLLM's count).
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # of those, the ones found in the prefix cache
    # Output tokens the requests got (what their usage counts); not those a core sampled for a
    # request already finished here (a stop string) or aborted, as vLLM counts.
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)  # arrival to first token, front-end clock
    inter_token_latencies: list[float] = field(default_factory=list)  # between a sample's steps, core clock
    finished_samples: list[FinishedSample] = field(default_factory=list)
    finished_requests: list[FinishedRequest] = field(default_factory=list)


class OutputProcessor:
    """Keeps the front-end state of every in-flight request.

    Args:
        tokenizer: used for detokenization and logprob token strings.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self._child_to_parent: dict[str, tuple[RequestState, SampleState]] = {}
        self.metrics = StepMetrics()  # taken by ``take_metrics``

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        core_requests: list[EngineCoreRequest],
        stream: bool = False,
    ) -> None:
        first = core_requests[0]
        samples = [
            SampleState(
                i, r.sampling_params, IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids, r.sampling_params),
                frozenset(r.sampling_params.stop_token_ids) | frozenset(() if r.sampling_params.ignore_eos else r.eos_token_ids),
            )
            for i, r in enumerate(core_requests)
        ]
        state = RequestState(request_id, prompt, first.prompt_token_ids, samples, stream, first.arrival_time,
                             lora_request=first.lora_request)
        if first.sampling_params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
            if first.sampling_params.detokenize:
                state.prompt_texts = token_shares(self.tokenizer, first.prompt_token_ids)
        self.requests[request_id] = state
        for r, s in zip(core_requests, samples):
            self._child_to_parent[r.request_id] = (state, s)

    def take_metrics(self) -> StepMetrics:
        """What the outputs and aborts handled since the last call measured."""
        taken, self.metrics = self.metrics, StepMetrics()
        return taken

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return [] if state is None else [f"{request_id}-{s.index}" for s in state.samples]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished sample aborted and drop the request; return its final output."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        now = time.monotonic()
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
                self._record_finished(state, s, now)
        self.metrics.finished_requests.append(self._finished_request(state))
        self._drop(state)
        return self._make_output(state)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], timestamp: float
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one engine step's outputs; ``timestamp``: the step's (``EngineCoreOutputs.timestamp``).

        Returns:
            (request outputs to deliver, engine-core request ids to abort because a stop
            string ended them in the front end).
        """
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        metrics = self.metrics
        metrics.num_outputs += len(outputs)
        for out in outputs:
            entry = self._child_to_parent.get(out.request_id)
            if entry is None:
                continue  # finished here already (stop string) or aborted
            state, sample = entry
            touched[state.request_id] = state
            # Each of n samples scores the same prompt: the output holds the first's scores once.
            if out.prompt_logprobs is not None and state.prompt_logprobs is not None and sample.index == 0:
                detokenize = sample.detokenizer.params.detokenize
                # This chunk scores the prompt tokens from len(state.prompt_logprobs) on.
                texts = None if state.prompt_texts is None else state.prompt_texts[len(state.prompt_logprobs):]
                state.prompt_logprobs.extend(self._to_dicts(out.prompt_logprobs, texts, detokenize))
            state.num_cached_tokens = out.num_cached_tokens
            if out.queued_time is not None:
                sample.queued_ts, sample.scheduled_ts = out.queued_time, out.scheduled_time
            if sample.first_token_ts is None and (out.new_token_ids or out.finish_reason not in (None, "error")):
                metrics.num_prompt_tokens += len(state.prompt_token_ids)
                metrics.num_cached_prompt_tokens += out.num_cached_tokens
                sample.num_cached_tokens = out.num_cached_tokens
                sample.first_token_ts = sample.last_token_ts = timestamp
            if out.new_token_ids:
                self._record_timing(state, sample, now, timestamp)
                num_before = sample.detokenizer.num_output_tokens
                # Only a stop token's text is left out: a completed grammar also finishes with
                # "stop", on a token whose text is part of the output.
                stop_terminated = out.finish_reason == "stop" and out.new_token_ids[-1] in sample.stop_token_ids
                stop = sample.detokenizer.update(out.new_token_ids, stop_terminated=stop_terminated)
                # A stop string completed inside an accepted run of speculative drafts ends the
                # output at the token that completed it: the tokens after it are dropped.
                num_new = sample.detokenizer.num_output_tokens - num_before
                sample.token_ids.extend(out.new_token_ids[:num_new])
                metrics.num_generation_tokens += num_new
                if out.logprobs is not None:
                    self._add_logprobs(sample, out.logprobs.first(num_new), sample.detokenizer.token_texts)
                if stop is not None:
                    sample.finish_reason, sample.stop_reason = "stop", stop
                    if out.finish_reason is None:  # the core still runs it
                        to_abort.append(out.request_id)
            if sample.finish_reason is None and out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
                if out.error is not None:
                    sample.error, sample.error_param = out.error.message, out.error.param
                sample.final_delta = sample.detokenizer.flush()
            if sample.finish_reason is not None:
                self._child_to_parent.pop(out.request_id, None)
                self._record_finished(state, sample, now)

        results = []
        for state in touched.values():
            if state.finished:
                self.requests.pop(state.request_id, None)
                metrics.finished_requests.append(self._finished_request(state))
            if state.stream or state.finished:
                results.append(self._make_output(state))
        return results, to_abort

    # -- helpers -------------------------------------------------------------------------
    def _record_timing(self, state: RequestState, sample: SampleState, now: float, timestamp: float) -> None:
        """A sample got tokens at ``now`` (here) from the step of ``timestamp`` (its core's clock)."""
        if sample.first_token_time is None:
            sample.first_token_time = now
            self.metrics.time_to_first_tokens.append(now - state.arrival_time)
        else:
            self.metrics.inter_token_latencies.append(timestamp - sample.last_token_ts)
        sample.last_token_time = now
        sample.last_token_ts = timestamp

    def _record_finished(self, state: RequestState, sample: SampleState, now: float) -> None:
        """The sample has just finished (at ``now``, here): its per-request metrics."""
        queued, scheduled = sample.queued_ts, sample.scheduled_ts
        first, last = sample.first_token_ts, sample.last_token_ts
        self.metrics.finished_samples.append(
            FinishedSample(
                sample.finish_reason,
                now - state.arrival_time,
                len(state.prompt_token_ids),
                sample.num_cached_tokens,
                len(sample.token_ids),
                sample.params.max_tokens,
                None if queued is None or scheduled is None else scheduled - queued,
                None if scheduled is None or first is None else first - scheduled,
                None if first is None else last - first,
                None if scheduled is None or last is None else last - scheduled,
            )
        )

    @staticmethod
    def _finished_request(state: RequestState) -> FinishedRequest:
        return FinishedRequest(len(state.samples), max(len(s.token_ids) for s in state.samples))

    def _add_logprobs(self, sample: SampleState, lp: TokenLogprobs, texts: list[str]) -> None:
        if sample.logprobs is None:
            sample.logprobs, sample.cumulative_logprob = [], 0.0
        for entry in self._to_dicts(lp, texts, sample.detokenizer.params.detokenize):
            sample.logprobs.append(entry)
        sample.cumulative_logprob += sum(row[0] for row in lp.logprobs)

    def _to_dicts(
        self, lp: TokenLogprobs, texts: list[str] | None = None, detokenize: bool = True
    ) -> list[dict[int, Logprob]]:
        """vLLM's logprob dicts. ``texts``: the chosen tokens' shares of the output text
        (from the detokenizer), so that the chosen tokens' strings join to the text. Without
        ``detokenize`` (``SamplingParams.detokenize``) no token is decoded: ``decoded_token``
        and ``token_bytes`` are None, as vLLM leaves them."""
        result = []
        for pos, (ids, lps, rank) in enumerate(zip(lp.token_ids, lp.logprobs, lp.ranks)):
            entry: dict[int, Logprob] = {}
            for j, (tid, value) in enumerate(zip(ids, lps)):
                if tid not in entry and not detokenize:
                    entry[tid] = Logprob(value, rank if j == 0 else j)
                elif tid not in entry:  # the chosen token may also be among the top-N
                    text = token_text(self.tokenizer, tid)
                    # In context the chosen token may complete a character; a token the text
                    # skips (a special token) keeps its own string.
                    if j == 0 and texts is not None and pos < len(texts) and texts[pos]:
                        text = texts[pos]
                    entry[tid] = Logprob(value, rank if j == 0 else j, text, self.token_bytes(tid))
            result.append(entry)
        return result

    def _make_output(self, state: RequestState) -> RequestOutput:
        outputs = []
        for s in state.samples:
            if state.stream:
                tokens = s.token_ids[s.num_sent_tokens :]
                logprobs = None if s.logprobs is None else s.logprobs[s.num_sent_logprobs :]
                text = s.final_delta + s.detokenizer.get_delta()
                s.final_delta = ""
                s.num_sent_tokens = len(s.token_ids)
                s.num_sent_logprobs = 0 if s.logprobs is None else len(s.logprobs)
            else:
                tokens, logprobs, text = list(s.token_ids), s.logprobs, s.detokenizer.output_text
            outputs.append(
                CompletionOutput(
                    s.index, text, tokens, s.finish_reason, s.stop_reason, logprobs, s.cumulative_logprob, s.error,
                    s.error_param, state.lora_request,
                )
            )
        first_times = [s.first_token_time for s in state.samples if s.first_token_time is not None]
        metrics = {"arrival_time": state.arrival_time}  # seconds, time.monotonic(); token times once there are tokens
        if first_times:
            metrics["first_token_time"] = min(first_times)
            metrics["last_token_time"] = max(s.last_token_time for s in state.samples if s.last_token_time is not None)
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            outputs,
            state.finished,
            state.prompt_logprobs,
            state.num_cached_tokens,
            metrics,
            state.lora_request,
        )

    def _drop(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for i in range(len(state.samples)):
            self._child_to_parent.pop(f"{state.request_id}-{i}", None)

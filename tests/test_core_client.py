"""The engine core in its own process, driven over ZeroMQ by the blocking client."""

from __future__ import annotations

import time

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import EngineDeadError, SyncMPClient
from pagedllm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from pagedllm.sampling_params import SamplingParams


def _request(request_id: str, max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return EngineCoreRequest(request_id, [1, 504, 3458, 314, 253], params, [2], time.monotonic())


def _until(client: SyncMPClient, done) -> EngineCoreOutputs:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        out = client.get_output()
        if done(out):
            return out
    raise AssertionError("the core did not get there")


def test_core_process_round_trip() -> None:
    client = SyncMPClient(EngineConfig(kv_cache_memory=64 * 1024**2, max_model_len=512))
    try:
        ready = client.wait_ready()
        kv = ready.kv_cache_config
        assert kv.max_model_len == 512 and kv.num_blocks > 0 and ready.model_config.vocab_size > 0

        tokens: list[int] = []

        def finished(out: EngineCoreOutputs) -> bool:
            for o in out.outputs:
                tokens.extend(o.new_token_ids)
            return any(o.finish_reason for o in out.outputs)

        client.add_requests([_request("a", 4)])
        last = _until(client, finished)
        assert len(tokens) == 4 and last.outputs[0].finish_reason == "length"
        assert last.stats.num_running == 0 and last.stats.kv_cache_usage == 0

        # An abort frees the request's blocks; the core then reports idle stats by itself.
        client.add_requests([_request("b", 400)])
        assert _until(client, lambda out: out.stats.num_running == 1).stats.kv_cache_usage > 0
        client.abort_requests(["b"])
        idle = _until(client, lambda out: out.stats is not None and out.stats.num_running == 0)
        assert idle.stats.kv_cache_usage == 0

        assert client.call_utility("reset_prefix_cache") is True

        client.proc.kill()  # as the OOM killer would: named, not "exited with code None"
        with pytest.raises(EngineDeadError, match="the engine core process was killed by SIGKILL"):
            client.get_output()
    finally:
        client.shutdown()
    assert not client.proc.is_alive()


def test_core_startup_error_is_reported() -> None:
    client = SyncMPClient(EngineConfig(model="no-such-model"))
    try:
        with pytest.raises(RuntimeError, match="no-such-model"):
            client.wait_ready()
    finally:
        client.shutdown()


def test_a_core_still_starting_is_stopped_without_the_grace_wait(caplog: pytest.LogCaptureFixture) -> None:
    """The front end failed first (`serve --model` of an unknown name, found while the core still
    imports): the core reads no input before its handshake, so it is killed at once, not asked
    to stop and waited for (which used to end in "did not stop within 5 s; killing it")."""
    client = SyncMPClient(EngineConfig(kv_cache_memory=64 * 1024**2, max_model_len=512))
    client.shutdown()
    assert not client.proc.is_alive()
    assert "did not stop" not in caplog.text

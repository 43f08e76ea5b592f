"""What the live view sums up: the headline's rates and queues, the request rows and their order."""

import random

from pagedllm.core.request import RequestStatus
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagedllm.live_view.view import LiveView
from pagedllm.sampling_params import SamplingParams
from tests.live_view_util import LIVE_VIEW_BS as BS
from tests.live_view_util import LIVE_VIEW_EOS as EOS
from tests.live_view_util import LIVE_VIEW_GLOBAL as GLOBAL
from tests.live_view_util import fake_step, fed_steps, make_engine, make_request


def test_rates_cover_a_recent_window_and_fall_to_zero_when_idle():
    view = LiveView(20, BS, [0], 24)
    for _ in fed_steps(view, stops=False):
        pass
    last = view.steps[-1].end
    busy = view.headline(last)
    assert busy["tokens_out_per_s"] > 0 and busy["tokens_in_per_s"] > 0
    later = view.headline(last + 2.0)  # the same tokens over a longer span
    assert 0 < later["tokens_out_per_s"] < busy["tokens_out_per_s"]
    idle = view.headline(last + 60.0)
    assert idle["tokens_out_per_s"] == idle["tokens_in_per_s"] == 0.0
    assert idle["steps"] == busy["steps"] == len(view.steps)


def test_headline_after_aborts_with_the_engine_idle():
    """Aborts with no step after them: the core's idle record sets the headline's queues and KV
    usage (as /metrics), not the last step's; the steps shown stay as they were."""
    rng = random.Random(5)
    sched, recorder = make_engine(GLOBAL)
    view = LiveView(20, BS, [0], 24)
    for i in range(4):
        request = make_request(f"r{i}", rng, [[11, 12, 13, 14]])
        sched.add_request(request)
        view.on_arrival([EngineCoreRequest(request.request_id, request.prompt_token_ids, request.sampling_params,
                                           [EOS], request.arrival_time)])
    for _ in range(2):
        record = fake_step(sched, recorder, rng)
        view.on_outputs(EngineCoreOutputs([], timestamp=record.end, step=record))
    busy = view.headline(record.end)
    assert busy["running"] > 0 and busy["kv_usage"] > 0
    sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
    idle = recorder.finish(sched, sched.kv_cache.usage)
    view.on_outputs(EngineCoreOutputs(timestamp=idle.end, step=idle))
    headline = view.headline(idle.end)
    assert (headline["running"], headline["waiting"], headline["kv_usage"]) == (0, 0, 0.0)
    assert headline["steps"] == busy["steps"] and len(view.steps) == 2
    assert all(r == 0 for r in view.blocks.ref)


def test_a_row_ends_when_the_front_end_ends_its_request():
    """The core's step in flight when the front end ended a request (a stop string, a client
    gone) comes after the finish: its tokens and time are no longer the row's, whose output
    counts what the request got and whose bars end at its finish tick."""
    rng = random.Random(3)
    sched, recorder = make_engine(GLOBAL)
    request = make_request("r0", rng, [[11, 12, 13, 14]])
    sched.add_request(request)
    view = LiveView(20, BS, [0], 24)
    view.on_arrival([EngineCoreRequest("r0", request.prompt_token_ids, request.sampling_params, [EOS],
                                       request.arrival_time)])
    first = fake_step(sched, recorder, rng)
    view.on_outputs(EngineCoreOutputs([EngineCoreOutput("r0", [7])], timestamp=first.end, step=first))
    view.on_finish(["r0"], "abort", first.end)
    late = fake_step(sched, recorder, rng)  # the abort had not reached the core yet
    view.on_outputs(EngineCoreOutputs([EngineCoreOutput("r0", [7])], timestamp=late.end, step=late))
    (row,) = [t.to_json() for t in view.shown_requests(10)]
    assert row["output"] == 1 and row["last_token"] == row["finished"] == first.end
    assert all(end <= row["finished"] for _, end, _ in row["segments"])
    assert len(view.steps) == 2  # the step itself is shown


def test_shown_requests_put_unfinished_first_then_the_latest_finished():
    view = LiveView(20, BS, [0], 24)
    for rid, t in [("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0), ("e", 5.0)]:
        view.on_arrival([EngineCoreRequest(rid, [5, 6], SamplingParams(), [EOS], t)])
    view.on_finish(["c"], "stop", 10.0)
    view.on_finish(["a"], "stop", 11.0)
    view.on_finish(["b"], "length", 9.0)
    assert [t.request_id for t in view.shown_requests(40)] == ["d", "e", "a", "c", "b"]
    assert [t.request_id for t in view.shown_requests(3)] == ["d", "e", "a"]
    assert [t.request_id for t in view.shown_requests(1)] == ["d"]


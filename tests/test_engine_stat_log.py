"""The stat logger's line: ticked by the server's timer at each interval's end, none while the engine idles."""


def test_stat_log_line_after_a_burst_and_none_while_idle(monkeypatch, caplog) -> None:
    """The server's timer ticks the log line: a burst's last line comes when its interval ends
    (its last tokens, the idle engine's stats), not with the next request averaged over the
    idle time between; an idle engine logs nothing; an interval starts with its first step."""
    from pagedllm.engine import stat_logger
    from pagedllm.engine.messages import SchedulerStats

    now = [0.0]
    monkeypatch.setattr(stat_logger.time, "monotonic", lambda: now[0])
    log = stat_logger.StatLogger(interval=5.0)

    def lines_at(t: float, *record) -> list[str]:
        now[0] = t
        caplog.clear()
        with caplog.at_level("INFO", logger="pagedllm"):
            log.record(*record) if record else log.tick()
        return [r.getMessage() for r in caplog.records]

    assert lines_at(100.0, SchedulerStats(num_running=2, kv_cache_usage=0.5), 40, 10) == []
    assert lines_at(103.0, SchedulerStats(), 0, 10) == []  # the burst ends: the core's idle stats
    (line,) = lines_at(105.0)
    assert "prompt throughput: 8.0 tok/s, generation throughput: 4.0 tok/s, running: 0," in line
    assert "KV cache usage: 0.0%" in line
    assert lines_at(110.0) == lines_at(500.0) == []
    assert lines_at(900.0, SchedulerStats(num_running=1), 30, 0) == []
    (line,) = lines_at(905.0, None, 0, 20)
    assert "prompt throughput: 6.0 tok/s, generation throughput: 4.0 tok/s, running: 1," in line


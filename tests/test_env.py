"""``pagedllm env`` reports the machine, the install and the kernel variants without compiling."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main
from pagedllm.kernels import library
from pagedllm.kernels.isa import cpu_flags


def _env_rows(capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """`pagedllm env`'s rows, key -> value (padded as printed)."""
    main(["env"])
    return dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())


def test_env_reports_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-c++")
    for name in ("PAGEDLLM_CPU_ISA", "PAGEDLLM_DISABLE_NATIVE"):
        monkeypatch.delenv(name, raising=False)
    rows = _env_rows(capsys)
    rows = {key: value.strip() for key, value in rows.items()}
    assert {"pagedllm", "torch", "cpu", "cpu cores", "kernels chosen", "c++ compiler"} <= set(rows)
    # What a bug report about loading or templates needs; the CPU's family and model (the name
    # may be only "AMD EPYC").
    assert "transformers " in rows["libraries"] and "gguf " in rows["libraries"]
    assert "SmolLM2-135M-Instruct" in rows["packaged models installed"]
    if Path("/proc/cpuinfo").exists() and "family" in Path("/proc/cpuinfo").read_text():
        assert ", family " in rows["cpu"]
    best = library.available_isas()[0]
    assert rows[f"kernels {best}"] == "not built" or rows[f"kernels {best}"].startswith("shipped")
    assert rows["kernels chosen"].startswith(f"{best}, ")
    assert rows["c++ compiler"].startswith("none")
    assert not list(tmp_path.iterdir())  # nothing built, no failure recorded


@pytest.mark.parametrize(("forced", "what"), [("bogus", "an unknown ISA"), ("BOGUS", "an unknown ISA")])
def test_env_reports_a_forced_isa_every_run_refuses(
    forced: str, what: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It reported the variant a run would take without the variable: the report of a machine
    on which every command fails."""
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", forced)
    monkeypatch.delenv("PAGEDLLM_DISABLE_NATIVE", raising=False)
    rows = _env_rows(capsys)
    assert rows["kernels chosen"].strip().startswith(f"none: PAGEDLLM_CPU_ISA={forced!r} is {what}")


def test_env_takes_a_forced_isa_in_any_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``PAGEDLLM_CPU_ISA=SCALAR`` forces the scalar variant, as every command reads it; it was
    reported as an unknown ISA."""
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "SCALAR")
    monkeypatch.delenv("PAGEDLLM_DISABLE_NATIVE", raising=False)
    rows = _env_rows(capsys)
    assert rows["kernels chosen"].strip().startswith("scalar, ")


def test_env_says_whether_prompt_rows_take_amx(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PAGEDLLM_DISABLE_AMX", "1")
    rows = _env_rows(capsys)
    amx = {"amx_tile", "amx_bf16"} <= cpu_flags()
    assert rows["int8 layers' prompt rows on AMX tiles"].strip() == (
        "no: PAGEDLLM_DISABLE_AMX=1" if amx else "no: this CPU has no AMX-BF16"
    )


def test_env_says_whether_packed_weights_take_huge_pages(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PAGEDLLM_DISABLE_HUGE_PAGES", "1")
    rows = _env_rows(capsys)
    assert rows["packed weights and K/V caches in 2 MiB pages"].strip() == "no: PAGEDLLM_DISABLE_HUGE_PAGES=1"
    monkeypatch.delenv("PAGEDLLM_DISABLE_HUGE_PAGES")
    rows = _env_rows(capsys)
    assert rows["packed weights and K/V caches in 2 MiB pages"].strip().startswith(("asked for", "no: this system"))

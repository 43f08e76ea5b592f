"""``pagedllm env``: what a bug report needs about this machine and install, one ``key: value``
per line (vLLM's ``collect-env`` is the model).

Nothing is compiled unless ``--load`` asks: the kernel variant shown as chosen is the one a
run would take (the best this CPU executes whose library is shipped or cached, else the best
it would build); ``--load`` loads it, building it first where needed, and reports the result.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path


def add_env_args(env: argparse.ArgumentParser) -> None:
    """``pagedllm env``'s flags."""
    env.add_argument(
        "--load", action="store_true", help="load the kernels (compiling them first if needed) and report that"
    )
    env.set_defaults(func=run)


def report(load: bool = False) -> list[tuple[str, str]]:
    """(key, value) pairs: versions, CPU, threads, the kernel variants, caches, compiler."""
    import torch

    import pagedllm
    from pagedllm.kernels import build, isa, library
    from pagedllm.models.loader import installed_models

    machine = platform.machine()
    flags = isa.cpu_flags()
    variants = isa.architecture_isas(machine)
    runnable = library.available_isas()
    used = sorted(set().union(*(isa.required_features(v) for v in variants)))
    compiler_path, compiler_version = build.compiler()
    rows = [
        ("pagedllm", f"{pagedllm.__version__} ({Path(pagedllm.__file__).parent})"),
        ("python", f"{sys.version.split()[0]} ({sys.executable})"),
        ("torch", f"{torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"),
        ("libraries", _versions(("transformers", "tokenizers", "gguf", "llguidance", "fastapi"))),
        ("packaged models installed", ", ".join(installed_models()) or "none"),
        ("os", platform.platform()),
        ("cpu", f"{_cpu_model()} ({machine})"),
        ("cpu features needed (-x = missing)", " ".join(f if f in flags else f"-{f}" for f in used) or "none"),
        ("cpu cores", f"{os.cpu_count()}, this process may run on {len(os.sched_getaffinity(0))}: "
                      f"{_ranges(sorted(os.sched_getaffinity(0)))}"),
        ("torch threads", str(torch.get_num_threads())),
    ]
    rows += [(name, os.environ[name]) for name in sorted(os.environ) if name.startswith(("PAGEDLLM_", "OMP_", "GOMP_"))]
    for variant in variants:
        rows.append((f"kernels {variant}", _variant_state(variant, variant in runnable)))
    rows.append(("kernels chosen", _chosen(runnable, load)))
    rows.append(("int8 layers' prompt rows on AMX tiles", _amx(flags, load)))
    rows.append(("packed weights and K/V caches in 2 MiB pages", _huge_pages()))
    rows += [
        ("pagedllm cache (kernels, models)", str(build.cache_dir())),
        ("huggingface cache", os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))),
        ("c++ compiler", f"{compiler_path} ({compiler_version})" if compiler_version else f"none ({compiler_path})"),
    ]
    return rows


def run(args: argparse.Namespace) -> None:
    rows = report(load=args.load)
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key + ':':<{width + 1}} {value}")


def _variant_state(variant: str, runs: bool) -> str:
    from pagedllm.kernels import build

    path = build.library_path(variant)
    if path.parent == build.PREBUILT:
        state = f"shipped ({path})"
    elif path.exists():
        state = f"built ({path})"
    elif path.with_suffix(".failed").exists():
        state = f"failed to build ({path.with_suffix('.failed')})"
    else:
        state = "not built"
    return state + ("" if runs else "; this CPU cannot run it")


def _chosen(runnable: list[str], load: bool) -> str:
    from pagedllm.kernels import build, library

    if build.env_switch("PAGEDLLM_DISABLE_NATIVE"):
        return "none: PAGEDLLM_DISABLE_NATIVE=1"
    if load:
        active = library.active_isa()
        return f"{active} ({build.library_path(active)})" if active else "none: no variant builds or loads (see above)"
    try:
        forced = library.forced_isa()
    except ValueError as e:  # what a run would say, not the variant it would take without the variable
        return f"none: {e} (every command refuses it)"
    candidates = runnable[runnable.index(forced):] if forced else runnable
    for variant in candidates:
        if build.library_path(variant).exists():
            return f"{variant}, without compiling (--load to load it)"
    for variant in candidates:
        if not build.library_path(variant).with_suffix(".failed").exists():
            return f"{variant}, compiled on first use (--load to do it now)"
    return "none: every variant failed to build before"


def _amx(flags: frozenset[str], load: bool) -> str:
    """Whether the int8 formats' prompt rows take AMX's bfloat16 tiles (``kernels.linear.amx_tiles``)."""
    from pagedllm.kernels import build, library, linear

    if not {"amx_tile", "amx_bf16"} <= flags:
        return "no: this CPU has no AMX-BF16"
    if build.env_switch("PAGEDLLM_DISABLE_AMX"):
        return "no: PAGEDLLM_DISABLE_AMX=1"
    if not load:
        return "yes where the avx512_bf16 kernels run and Linux grants the tiles (--load to check)"
    if library.active_isa() != "avx512_bf16":
        return "no: the avx512_bf16 kernels do not run"
    return "yes" if linear.amx_tiles() else "no: Linux does not grant this process the tiles"


def _huge_pages() -> str:
    """Whether packed weights and the K/V caches go to mappings advised as huge pages
    (``kernels.huge_pages``), and what Linux's transparent huge pages setting makes of the advice."""
    from pagedllm.kernels import build, huge_pages

    if build.env_switch("PAGEDLLM_DISABLE_HUGE_PAGES"):
        return "no: PAGEDLLM_DISABLE_HUGE_PAGES=1"
    if not huge_pages.enabled():
        return "no: this system has no MADV_HUGEPAGE"
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "asked for; transparent huge pages' setting unknown"
    granted = "granted" if mode in ("always", "madvise") else "not granted: plain pages"
    return f"asked for; transparent huge pages {mode!r}: {granted}"


def _cpu_model() -> str:
    """The first CPU's model name, with its family, model and stepping where Linux gives them
    (what tells a Zen 3 from a Zen 4 when the name is only "AMD EPYC")."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip() and fields:
                break  # the first CPU's block ends
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    ids = ", ".join(f"{k.replace('cpu ', '')} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields)
    return f"{name}, {ids}" if ids else name


def _versions(names: tuple[str, ...]) -> str:
    """``name version`` of each installed distribution of ``names``, comma separated."""
    from importlib import metadata

    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for cpu in cpus:
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)

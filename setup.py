"""The wheel's native kernels: ``build_py`` compiles every kernel variant of the build
machine's architecture (``pagedllm.kernels.isa.architecture_isas``; ``PAGEDLLM_WHEEL_ISAS``,
comma separated, chooses others) with ``pagedllm/kernels/build.py``'s own recipe and flags,
into ``pagedllm/kernels/prebuilt/kernels-<isa>.so``, and the wheel is tagged for the platform
(the libraries are plain C ABI: any CPython 3). They go through the kernel cache
(``$PAGEDLLM_CACHE``), so a build from the same sources with the same compiler reuses them.
An editable install compiles nothing here: its kernels are built on first use.
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import sys
import types
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _kernel_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """``pagedllm.kernels.build`` and ``.isa`` without running ``pagedllm/__init__.py``, whose
    imports the isolated build environment does not have (they use the standard library only)."""
    for name, folder in (("pagedllm", ROOT / "pagedllm"), ("pagedllm.kernels", ROOT / "pagedllm" / "kernels")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules.setdefault(name, package)
    return importlib.import_module("pagedllm.kernels.build"), importlib.import_module("pagedllm.kernels.isa")


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        build, isa = _kernel_modules()
        wanted = os.environ.get("PAGEDLLM_WHEEL_ISAS")
        variants = wanted.split(",") if wanted else isa.architecture_isas(platform.machine())
        target = Path(self.build_lib) / "pagedllm" / "kernels" / "prebuilt"
        shutil.rmtree(target, ignore_errors=True)  # a reused build folder keeps another build's variants
        target.mkdir(parents=True)
        for variant in variants:
            print(f"pagedllm: the {variant} kernels ({' '.join(isa.isa_flags(variant))})", flush=True)
            try:
                library = build.cached_build(variant)
            except build.BuildFailed as e:
                raise SystemExit(f"pagedllm: the {variant} kernels failed to build:\n  " + "\n  ".join(e.errors))
            shutil.copyfile(library, target / build.prebuilt_path(variant).name)


class NativeDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        return True  # native libraries inside: a platform wheel, installed as platlib


class PlatformWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", super().get_tag()[2]  # no CPython extension: any Python 3


setup(distclass=NativeDistribution, cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel})

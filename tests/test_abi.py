"""The kernels' C interface is declared once (csrc/pagedllm_abi.h): the parser reads it, the
built library exports exactly its functions, the binding covers each, and each variant's
library reports the CPU features its name stands for."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
from tests.native_isa import ISAS

from pagedllm.kernels import abi, build
from pagedllm.kernels.isa import required_features
from pagedllm.kernels.library import native_library


def test_the_header_declares_the_kernels_structs_and_limits() -> None:
    assert {"decode_layers", "linear_w8a8", "paged_prefill_attention", "pagedllm_limits"} <= set(abi.FUNCTIONS)
    restype, argtypes = abi.FUNCTIONS["decode_layers"]
    assert restype is ctypes.c_int and argtypes[0] is ctypes.POINTER(abi.STRUCTS["DecoderDesc"])
    assert abi.FUNCTIONS["add_rms_norm"] == (
        None, [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    )
    layer = dict(abi.STRUCTS["LayerDesc"]._fields_)
    assert layer["qkv"] is abi.STRUCTS["LinearDesc"] and layer["window"] is ctypes.c_int64
    assert abi.CONSTANTS["PAGEDLLM_HEAD_DIMS"] == (64, 128, 256)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("#define N (1 << 3)\n", "not an integer"),
        ("#if X\n", "unsupported preprocessor line"),
        ("typedef struct A { int x; } B;", "the two names must be equal"),
        ("typedef struct A { unsigned x; } A;", "unknown type"),
        ("int f(int (*cb)(void));", "expected '<type> <name>'"),
        ("int f(void)", "unterminated"),
        ("int x = 3;", "not a struct typedef or a prototype"),
    ],
)
def test_the_parser_refuses_what_it_does_not_read(text: str, complaint: str) -> None:
    with pytest.raises(abi.HeaderError, match=complaint):
        abi.parse(text)


@pytest.mark.parametrize("isa", ISAS)
def test_each_library_exports_the_header_and_reports_its_needs(isa: str) -> None:
    lib = native_library(isa)
    if lib is None:
        pytest.skip(f"the {isa} kernels do not build here")
    if shutil.which("nm") is None:
        pytest.skip("no nm")
    listed = subprocess.run(
        ["nm", "-D", "--defined-only", str(build.library_path(isa))], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in listed.splitlines() if line.split()[1] in ("T", "t")}
    assert exported == set(abi.FUNCTIONS)
    for name, (restype, argtypes) in abi.FUNCTIONS.items():
        assert getattr(lib, name).argtypes == argtypes and getattr(lib, name).restype is restype, name
    assert frozenset(lib.pagedllm_requires().decode().split()) == required_features(isa)

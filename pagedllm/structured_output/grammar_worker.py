"""A grammar worker process: ``python -m pagedllm.structured_output.grammar_worker``.

Reads jobs from stdin and writes replies to stdout, each a 4-byte little-endian length and a
msgpack body: a job is ``[kind, text]`` (a constraint's ``StructuredOutputsParams.key``); a
reply is ``["ok", grammar]`` or ``["error", param, message]``. Exits when stdin closes. A
grammar that crashes the native compiler ends this process, never the one that asked.
"""

from __future__ import annotations

import signal
import struct
import sys

import msgspec

from pagedllm.errors import InvalidParamError
from pagedllm.structured_output.grammar import compile_check

HEADER = struct.Struct("<I")


def read_frame(stream) -> bytes | None:
    """One length-prefixed frame from a binary stream; None at end of stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    body = stream.read(size)
    return body if len(body) == size else None


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the reply stream
    while (job := read_frame(stdin)) is not None:
        kind, text = msgspec.msgpack.decode(job)
        try:
            reply = ["ok", compile_check(kind, text)]
        except InvalidParamError as e:
            reply = ["error", e.param, str(e)]
        stdout.write(frame(msgspec.msgpack.encode(reply)))
        stdout.flush()


if __name__ == "__main__":
    main()

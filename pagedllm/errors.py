"""The errors shared by every layer: plain exceptions at the bottom of the import graph."""

from __future__ import annotations


class InvalidParamError(ValueError):
    """A ValueError that names the request field at fault (the server's ``param``).

    Args:
        param: the field, dotted for nested values (``"messages.0.content"``).
        message: what is wrong and what is allowed.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class LoRAError(ValueError):
    """A LoRA adapter that cannot be served: unreadable, unsupported, too large a rank, or
    made for another base model (the server's 400); the message names the problem."""

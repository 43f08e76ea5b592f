"""``SpeculativeConfig``: which proposer drafts tokens and how many, in vLLM's shape.

Given as a dict or a JSON string, e.g.
``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}``
or ``{"method": "draft_model", "model": "path/or/alias", "num_speculative_tokens": 4}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

Method = Literal["ngram", "draft_model"]
_METHODS = ("ngram", "draft_model")
# vLLM's defaults when neither bound of the n-gram length is given.
_DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings.

    Attributes:
        method: "ngram" (prompt lookup) or "draft_model" (a smaller model with the same vocabulary).
        num_speculative_tokens: k, the most draft tokens verified per request and step.
        prompt_lookup_min, prompt_lookup_max: n-gram lengths tried (ngram only); if one is
            given the other defaults to it, if neither both are 5 (as in vLLM).
        model: the draft model: a .gguf path, an HF directory or an installed alias (draft_model only).
        disable_by_batch_size: propose no drafts while at least this many requests run (None:
            always propose). On a CPU a step of many requests is compute-bound, so each draft
            token costs about as much as a decode token; speculation pays only at small batches.
    """

    method: Method
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(f"speculative_config method must be one of {list(_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be a positive integer, got {k!r}")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be a positive integer, got {b!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config model is only for method 'draft_model'")
            lo = self.prompt_lookup_min if self.prompt_lookup_min is not None else self.prompt_lookup_max
            hi = self.prompt_lookup_max if self.prompt_lookup_max is not None else self.prompt_lookup_min
            lo = _DEFAULT_LOOKUP if lo is None else lo
            hi = _DEFAULT_LOOKUP if hi is None else hi
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
            if lo > hi:
                raise ValueError(f"speculative_config prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            if not self.model or not isinstance(self.model, str):
                raise ValueError("speculative_config method 'draft_model' needs a 'model' (path or alias)")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("speculative_config prompt_lookup_min/max are only for method 'ngram'")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from a dict or a JSON object string; None and configs pass through.

        Raises:
            ValueError: for bad JSON, unknown keys, a missing or bad value. Without a method it
                is vLLM's inference from ``model``: "ngram" / "[ngram]" prompt lookup, any other
                a draft model.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object or dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known keys: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        if "method" not in value:  # vLLM infers it from the model: "[ngram]" is prompt lookup
            model = value.get("model")
            if model is None:
                raise ValueError(f"speculative_config needs a method, one of {list(_METHODS)}, or a model")
            ngram = model in ("ngram", "[ngram]")
            value = {k: v for k, v in value.items() if not (ngram and k == "model")}
            value["method"] = "ngram" if ngram else "draft_model"
        return cls(**value)

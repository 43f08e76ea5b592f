"""Speculative decoding's configuration: vLLM's --speculative-config shapes, the refusals, the CLI flag."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.speculative_config import SpeculativeConfig


def test_config_parses_vllm_shapes() -> None:
    ngram = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (ngram.method, ngram.num_speculative_tokens, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (
        "ngram", 3, 4, 4
    )
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "x", "num_speculative_tokens": 4})
    assert draft.model == "x" and EngineConfig(speculative_config=draft).speculative_config is draft
    assert EngineConfig(speculative_config=None).speculative_config is None
    # vLLM infers the method from the model when none is given
    assert SpeculativeConfig.parse({"model": "x", "num_speculative_tokens": 2}).method == "draft_model"
    lookup = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2})
    assert (lookup.method, lookup.model) == ("ngram", None)


@pytest.mark.parametrize(
    "value, match",
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "only for method 'draft_model'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "positive integer"),
    ],
)
def test_bad_configs_raise(value, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(speculative_config=value)  # fails in EngineConfig, before any model is loaded


def test_cli_flag_reaches_the_engine_kwargs() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    config = EngineConfig(speculative_config=EngineArgs.from_cli_args(args).kwargs()["speculative_config"])
    assert config.speculative_config.num_speculative_tokens == 2

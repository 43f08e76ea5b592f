"""The server's LoRA adapter registry (``serving_lora``) without a model: loads read and check
the files off the event loop and a name is taken once; ``--lora-modules`` takes ``name=path``
and vLLM's JSON form; an adapter's parent in /v1/models. The server serving adapters:
``test_lora_end_to_end_loading.py``."""

from __future__ import annotations

import re

import pytest

from pagedllm import LoRARequest



def test_adapters_load_off_the_event_loop_and_a_name_is_taken_once() -> None:
    """``/v1/load_lora_adapter`` reads and checks the files in a thread (the streams of other
    requests go on); two concurrent loads under one name: one is served, the other refused."""
    import asyncio
    import threading
    import time
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.errors import OpenAIError
    from pagedllm.entrypoints.openai.serving_lora import ServingLoRA

    loop_thread = threading.get_ident()
    checked_in: list[int] = []

    def check(lora: LoRARequest) -> None:
        checked_in.append(threading.get_ident())
        time.sleep(0.05)  # both loads are inside the check at once

    engine = SimpleNamespace(
        config=SimpleNamespace(enable_lora=True), processor=SimpleNamespace(lora=SimpleNamespace(check=check))
    )
    loras = ServingLoRA(engine, ("base",))

    async def both() -> list:
        return await asyncio.gather(loras.load_async("a", "/x"), loras.load_async("a", "/y"), return_exceptions=True)

    results = asyncio.run(both())
    assert loop_thread not in checked_in and len(checked_in) == 2
    assert sum(isinstance(r, LoRARequest) for r in results) == 1
    (refused,) = [r for r in results if isinstance(r, OpenAIError)]
    assert refused.status == 400 and "already in use" in refused.message
    assert list(loras.adapters) == ["a"]


def test_lora_modules_take_vllms_json_form() -> None:
    """``--lora-modules`` takes ``name=path`` and vLLM's JSON object (name and path required,
    base_model_name optional); any other key is refused by name."""
    from pagedllm.entrypoints.openai.lora_modules import LoRAModule, parse_lora_module

    assert parse_lora_module("a=/p=q") == LoRAModule("a", "/p=q")
    assert parse_lora_module('{"name": "a", "path": "/p"}') == LoRAModule("a", "/p")
    assert parse_lora_module('{"name": "a", "path": "/p", "base_model_name": "m"}') == LoRAModule("a", "/p", "m")
    assert parse_lora_module('{"name": "a", "path": "/p", "base_model_name": null}') == LoRAModule("a", "/p")
    for text, message in (
        ("a", "takes name=path or JSON object items"),
        ("=/p", "takes name=path or JSON object items"),
        ('{"name": "a", "path": "/p", "rank": 8}', "unknown key 'rank'"),
        ('{"path": "/p"}', "lacks 'name'"),
        ('{"name": "a", "path": 3}', "'path' must be a non-empty string, got 3"),
        ('{"name": "", "path": "/p"}', "'name' must be a non-empty string"),
        ('{"name": "a",', "is not valid JSON"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_lora_module(text)


def test_base_model_name_is_the_adapters_parent() -> None:
    """/v1/models gives an adapter the ``base_model_name`` it was served with as its parent,
    else the first served name; unloading it forgets that."""
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.serving_lora import LoRAModule, ServingLoRA

    engine = SimpleNamespace(
        config=SimpleNamespace(enable_lora=True), processor=SimpleNamespace(lora=SimpleNamespace(check=lambda lora: None))
    )
    loras = ServingLoRA(engine, ("base", "alias"))
    loras.load(LoRAModule("a", "/a", "alias"))
    loras.load(LoRAModule("b", "/b"))
    assert (loras.parent("a"), loras.parent("b")) == ("alias", "base")
    loras.unload("a")
    loras.load(LoRAModule("a", "/a"))
    assert loras.parent("a") == "base"

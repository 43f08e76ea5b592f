"""What the server answers before anything generates, in process with no model: the server
module's ``main`` on bad flags, ``--help`` and several served model names, and the app over a
stand-in engine (the ``app`` fixture): sampling defaults, parallel_tool_calls, CORS, /tokenize and
/detokenize off the event loop, and the refusals that name the field at fault."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from pagedllm.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tests.server_util import API_KEY, CHAT, MAX_MODEL_LEN, MODEL, _chat, _check_error, _completion


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(["--port", "99999"], "--port"), (["--port", "-1"], "--port"), (["--api-key="], "--api-key"),
     (["--max-request-body-size", "huge"], "huge"),
     (["--served-model-name="], "--served-model-name"), (["--allowed-origins", "*"], "--allowed-origins")],
)
def test_bad_server_flags_exit_2_before_loading(flags: list[str], needle: str, monkeypatch, capsys) -> None:
    # --port 99999 used to load the model, then die of an OverflowError traceback (exit 1); an empty
    # --api-key silently served without authentication, an empty --served-model-name under the
    # model argument's name. In process: the module's ``main`` is what
    # ``python -m`` runs (every server these tests start runs it that way).
    from pagedllm.entrypoints.openai import api_server, cli_args

    def load(_args) -> None:
        raise AssertionError("the model would be loaded")

    monkeypatch.setattr(cli_args, "run_serve", load)
    monkeypatch.setattr(sys, "argv", ["api_server", MODEL, *flags])
    with pytest.raises(SystemExit) as exited:
        api_server.main()
    assert exited.value.code == 2 and needle in capsys.readouterr().err


def test_server_module_help_shows_defaults(monkeypatch, capsys) -> None:
    from pagedllm.entrypoints.openai import api_server

    monkeypatch.setattr(sys, "argv", ["api_server", "--help"])
    with pytest.raises(SystemExit) as exited:
        api_server.main()
    text = " ".join(capsys.readouterr().out.split())  # as wrapped to any terminal width
    assert exited.value.code == 0 and "(default: 8000)" in text and "(default: 128)" in text


class _LoopFreeTokenizer:
    """A tokenizer that fails (so the route answers 500) when called on an event loop's thread."""

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer

    @staticmethod
    def _off_loop() -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        raise AssertionError("the tokenizer ran on the event loop")

    def __getattr__(self, name: str) -> object:
        self._off_loop()
        return getattr(self._tokenizer, name)

    def __call__(self, *args: object, **kwargs: object) -> object:
        self._off_loop()
        return self._tokenizer(*args, **kwargs)


@pytest.fixture(scope="module")
def stand_in_engine() -> SimpleNamespace:
    """An engine with the default model's tokenizer (which must never run on the event loop)
    and no model, for what the app answers before generating."""
    from pagedllm.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2"))
    return SimpleNamespace(tokenizer=_LoopFreeTokenizer(tokenizer), max_model_len=MAX_MODEL_LEN,
                           model_config=SimpleNamespace(vocab_size=len(tokenizer)), live_view=None,
                           config=SimpleNamespace(model=MODEL))


@pytest.fixture(scope="module")
def app(stand_in_engine: SimpleNamespace) -> TestClient:
    """The app in this process over the stand-in engine."""
    from pagedllm.entrypoints.openai.app import build_app

    return TestClient(build_app(stand_in_engine, (MODEL,)))


def test_several_served_model_names(stand_in_engine: SimpleNamespace, monkeypatch) -> None:
    """vLLM's --served-model-name a b (it was a usage error, or "b" taken for the model): a
    request may give any of the names, /v1/models lists each, another name is a 404 naming them."""
    from pagedllm.entrypoints.openai import api_server, cli_args
    from pagedllm.entrypoints.openai.app import build_app

    served = []
    monkeypatch.setattr(cli_args, "run_serve", lambda args: served.append(args.served_model_name))
    monkeypatch.setattr(sys, "argv", ["api_server", MODEL, "--served-model-name", "gpt-small", "smol"])
    api_server.main()
    assert served == [["gpt-small", "smol"]]
    app = TestClient(build_app(stand_in_engine, ("gpt-small", "smol")))
    assert [m["id"] for m in app.get("/v1/models").json()["data"]] == ["gpt-small", "smol"]
    for name in ("gpt-small", "smol"):
        assert app.post("/tokenize", json={"model": name, "prompt": "Hi"}).status_code == 200
    _check_error(app.post("/tokenize", json={"model": MODEL, "prompt": "Hi"}), 404, "serves `gpt-small`, `smol`")



def test_parallel_tool_calls_false_keeps_the_first_parsed_call(stand_in_engine: SimpleNamespace) -> None:
    """A parsed "auto" reply with two calls keeps both, and only the first under
    ``parallel_tool_calls: false`` (OpenAI's at most one call; vLLM keeps the first). It was ignored."""
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("f", "g")]
    serving = OpenAIServingChat(stand_in_engine, (MODEL,))
    text = '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    for parallel, names in ((None, ["f", "g"]), (False, ["f"])):
        req = ChatCompletionRequest.model_validate(_chat(tools=tools, parallel_tool_calls=parallel))
        message, finish_reason = serving._message(req, text, "stop")
        assert [c.function.name for c in message.tool_calls] == names and finish_reason == "tool_calls"
        assert message.tool_calls[0].function.arguments == '{"a": 1}'


def test_generation_config_defaults_fill_unset_fields(stand_in_engine: SimpleNamespace) -> None:
    """The model's generation_config.json sampling defaults (``ModelConfig.sampling_defaults``)
    fill the fields a request leaves unset or null, as vLLM's ``--generation-config auto``
    (they were ignored); a field the request sets wins, and without defaults nothing changes."""
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    model_config = SimpleNamespace(**vars(stand_in_engine.model_config), sampling_defaults=defaults)
    engine = SimpleNamespace(**(vars(stand_in_engine) | {"model_config": model_config}))
    completion = OpenAIServingCompletion(engine, (MODEL,))
    req = CompletionRequest.model_validate({"prompt": "Hi", "top_p": 0.5, "temperature": None})
    params = completion.sampling_params(req, 1, 4)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.7, 0.5, 20, 1.05)
    assert params.min_p == 0.0 and params.presence_penalty == 0.0
    chat = OpenAIServingChat(engine, (MODEL,))
    params = chat.sampling_params(ChatCompletionRequest.model_validate(_chat(temperature=0)), 1, 4)
    assert (params.temperature, params.top_k) == (0.0, 20)
    plain = OpenAIServingCompletion(stand_in_engine, (MODEL,)).sampling_params(req, 1, 4)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 0.5, 0, 1.0)
    # max_new_tokens (as max_tokens) caps every request's output, the rest of the context included.
    capped = SimpleNamespace(**(vars(engine) | {"model_config": SimpleNamespace(sampling_defaults={"max_tokens": 8})}))
    assert OpenAIServingCompletion(capped, (MODEL,)).sampling_params(req, 1, 16).max_tokens == 8
    assert OpenAIServingCompletion(capped, (MODEL,)).sampling_params(req, 1, 4).max_tokens == 4
    assert OpenAIServingChat(capped, (MODEL,)).sampling_params(req, 1, None).max_tokens == 8

def test_cors_preflight_before_the_key_and_headers_on_every_answer(
    app: TestClient, stand_in_engine: SimpleNamespace
) -> None:
    """vLLM's --allowed-origins: a browser page of an allowed origin gets its preflight answered
    without the key (a browser sends none with it), and the CORS headers on a 401 too, so it
    sees why; another origin's preflight is refused. Without the flag, no CORS headers at all."""
    from pagedllm.entrypoints.openai.app import build_app
    from pagedllm.entrypoints.openai.middleware import CorsPolicy

    page = "http://ui.example:3000"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = app.options("/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    cors = TestClient(build_app(stand_in_engine, (MODEL,), api_key=API_KEY, cors=CorsPolicy((page,))))
    r = cors.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page, r.text
    r = cors.post("/tokenize", json={"prompt": "Hi"}, headers={"Origin": page})
    _check_error(r, 401, "API key")
    assert r.headers["access-control-allow-origin"] == page
    r = cors.post("/tokenize", json={"prompt": "Hi"}, headers={"Origin": page, "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page, r.text
    r = cors.options("/v1/chat/completions", headers=preflight | {"Origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_tokenize_and_detokenize_run_off_the_event_loop(app: TestClient) -> None:
    """A large body to /tokenize or /detokenize must not stall every other client: the checks,
    the chat template and the (de)tokenizing run in a worker thread, as the /v1 routes' do."""
    r = app.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len(r.json()["token_strs"]) == 2
    r = app.post("/tokenize", json={"messages": CHAT})
    assert r.status_code == 200 and r.json()["count"] > 5, r.text
    r = app.post("/detokenize", json={"tokens": app.post("/tokenize", json={"prompt": "Hi there"}).json()["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hi there"}, r.text
    _check_error(app.post("/detokenize", json={"tokens": [10**9]}), 400, "vocabulary")


def test_tokenize_counts_the_tools_a_chat_completion_offers(app: TestClient, stand_in_engine: SimpleNamespace) -> None:
    """/tokenize with messages and tools gives the ids a chat completion offering those tools
    (tool_choice "auto") prefills, as vLLM's; it was a 400 (an unknown field)."""
    from pagedllm.entrypoints.openai.protocol import ChatMessage, ChatTool
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    serving = OpenAIServingChat(stand_in_engine, (MODEL,))
    expected = serving.render([ChatMessage.model_validate(m) for m in CHAT], True,
                              [ChatTool.model_validate(t) for t in tools])
    r = app.post("/tokenize", json={"messages": CHAT, "tools": tools})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expected
    assert r.json()["count"] > app.post("/tokenize", json={"messages": CHAT}).json()["count"]
    for body, needle in (({"prompt": "Hi", "tools": tools}, "messages, not prompt"),
                         ({"messages": CHAT, "tools": tools * 2}, "unique")):
        r = app.post("/tokenize", json=body)
        _check_error(r, 400, needle)
        assert r.json()["error"]["param"] == "tools"


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [(_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]),
      "messages.0.content.0.type", "Input should be 'text'"),
     (_chat(messages=[{"role": "user", "content": [{"type": "text", "txt": "Hi"}]}]), "messages.0.content.0.text",
      "Field required"),
     (_chat(tool_choice={"type": "function", "function": {}}), "tool_choice.function.name", "Field required"),
     (_chat(stop=["a", 5]), "stop.1", "valid string")],
)
def test_union_errors_name_the_member_meant(app: TestClient, body: dict, param: str, needle: str) -> None:
    """A value of a union field (content: text or parts; tool_choice: a mode or an object; stop)
    that fails inside the member it was meant for is reported there: an image part used to get
    "messages.0.content: Input should be a valid string", a tool choice object lacking its
    function's name "should be 'none', 'auto' or 'required'"."""
    r = app.post("/v1/chat/completions", json=body)
    _check_error(r, 400, needle)
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [({"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
     ({"prompt": "Hi", "add_generation_prompt": False}, "add_generation_prompt")],
)
def test_tokenize_settings_of_the_other_form_are_refused(app: TestClient, body: dict, param: str) -> None:
    """add_special_tokens does nothing to messages (the chat template writes the special tokens)
    nor add_generation_prompt to a prompt: refused, not silently ignored; messages with
    add_special_tokens false (vLLM's default for them) are what they do anyway."""
    r = app.post("/tokenize", json=body)
    _check_error(r, 400, f"{param} applies to")
    assert r.json()["error"]["param"] == param
    r = app.post("/tokenize", json={"messages": CHAT, "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["tokens"] == app.post("/tokenize", json={"messages": CHAT}).json()["tokens"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(
    ("message", "param"),
    [({"role": "user", "content": "Hi", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
      "messages.1.tool_calls"),
     ({"role": "user", "content": "Hi", "tool_call_id": "c"}, "messages.1.tool_call_id"),
     ({"role": "assistant", "content": "Hi", "tool_call_id": "c"}, "messages.1.tool_call_id")],
)
def test_message_fields_of_another_role_are_refused(app: TestClient, path: str, message: dict, param: str) -> None:
    """A user message's tool_calls or tool_call_id reached no template (the prompt was that of
    the message without them): refused naming the field, not silently ignored."""
    body = {"messages": [{"role": "system", "content": "Be brief."}, message]}
    r = app.post(path, json=_chat(**body) if path.startswith("/v1") else body)
    _check_error(r, 400, "belong")
    assert r.json()["error"]["param"] == param


def test_empty_body_is_named(app: TestClient) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = app.post(path, content=b"", headers={"Content-Type": "application/json"})
        _check_error(r, 400, "the request body is missing: it must be a JSON object")


@pytest.mark.parametrize("stop", [["x"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_STRING_CHARS + 1)]])
def test_stop_strings_are_capped(app: TestClient, stop: list[str]) -> None:
    """Stop strings are searched after every token of every sequence: beyond the caps (which
    test_validation.py shows are accepted) a request is refused, naming ``stop``."""
    for path, body in (("/v1/completions", _completion(stop=stop)), ("/v1/chat/completions", _chat(stop=stop))):
        r = app.post(path, json=body)
        _check_error(r, 400, "stop must be")
        assert r.json()["error"]["param"] == "stop"


def test_a_model_without_a_chat_template_says_so(stand_in_engine: SimpleNamespace, caplog) -> None:
    """A model with no chat template (Gemma 3's GGUF): the start-up log and every chat
    completion say so and name --chat-template (the log said the template "has no tool
    section", the 400 quoted transformers' error); completions are served as before."""
    import copy
    import logging

    from pagedllm.entrypoints.openai.app import build_app

    tokenizer = copy.copy(stand_in_engine.tokenizer._tokenizer)
    tokenizer.chat_template = None
    engine = SimpleNamespace(**(vars(stand_in_engine) | {"tokenizer": _LoopFreeTokenizer(tokenizer)}))
    with caplog.at_level(logging.INFO):
        client = TestClient(build_app(engine, (MODEL,)))
    assert "has no chat template" in caplog.text and "tool section" not in caplog.text
    _check_error(client.post("/v1/chat/completions", json=_chat()), 400, "the model has no chat template: start")
    assert client.post("/tokenize", json={"model": MODEL, "prompt": "Hi"}).status_code == 200


def test_echoed_logprobs_index_the_text_past_an_added_bos(stand_in_engine: SimpleNamespace) -> None:
    """A tokenizer that adds a BOS (gemma-3's): the echoed text is the prompt as sent, without
    "<bos>", so the BOS's token string is "" and every text_offset indexes the text (they
    counted the special token's characters, and ran backwards where the output began). A prompt
    sent as token ids is echoed decoded, special token and all, and keeps its string."""
    from pagedllm.entrypoints.openai.protocol import CompletionRequest
    from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput

    serving = OpenAIServingCompletion(stand_in_engine, (MODEL,))
    tok = serving.tokenizer
    special = tok.convert_tokens_to_ids("<|endoftext|>")  # standing in for a BOS
    ids, out_ids = tok.encode("The capital of France is"), tok.encode(" Paris.")

    def entry(t: int) -> dict[int, Logprob]:
        return {t: Logprob(-1.0, 1, tok.decode([t]))}

    c = CompletionOutput(0, " Paris.", out_ids, "length", logprobs=[entry(t) for t in out_ids])
    for prompt, first in (("The capital of France is", ""), (None, "<|endoftext|>")):
        out = RequestOutput("r", prompt, [special, *ids], [c], prompt_logprobs=[None, *map(entry, ids)])
        req = CompletionRequest.model_validate({"prompt": prompt or [special, *ids], "echo": True, "logprobs": 0})
        choice = serving._choice(req, out, c, 0, c.text, c.logprobs)
        lp = choice.logprobs
        assert lp.tokens[0] == first and "".join(lp.tokens) == choice.text
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]

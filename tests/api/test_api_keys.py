"""API keys (issue 25, item 4; docs/security.md): every endpoint, every method, no key / wrong key / right key.

A real ``mmgate serve`` + reference engine (``--api-key`` twice, ``--admin-api-key``) answers the ``/v1``
endpoints, streamed and not, through raw HTTP and through the ``openai`` and ``anthropic`` clients; two
in-thread gateways cover ``--protect-ops`` and a gateway with no key at all.  The expected answers are
written out here: OpenAI's 401 body (``{"error": {"type": "invalid_request_error", "code":
"invalid_api_key", ...}}``, as api.openai.com answers a bad key) and Anthropic's (``{"type": "error",
"error": {"type": "authentication_error", ...}}``, docs.anthropic.com ``/en/api/errors``), the
``X-SMG-Error-Code`` header and ``WWW-Authenticate: Bearer`` (RFC 6750 section 3).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from anthropic.types import MessageParam

from mmgate.api.keys import KeyGuard, key_matches
from mmgate.config.auth import AuthSettings, key_digest
from mmgate.config.settings import Settings, build_parser, parse_settings
from tests.abuse.support import DEFAULT_MODEL, Stack, bundle_path, running_stack
from tests.api.test_refusals import png_bytes, settings_for
from tests.support.servers import MediaOrigin, gateway_in_thread, media_origin

KEY_ONE = "sk-mmgate-test-key-one"
KEY_TWO = "sk-mmgate-test-key-two"
ADMIN = "sk-mmgate-test-admin-key"
WRONG = "sk-mmgate-test-wrong-key"
ALL_KEYS = (KEY_ONE, KEY_TWO, ADMIN, WRONG)
GUARD_CODES = {"invalid_api_key", "admin_api_disabled"}
Sse = tuple[str, ...] | None  # the lines one of which ends a streamed answer; None: not streamed


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, MediaOrigin, Path]]:
    logs: Path = tmp_path_factory.mktemp("logs")
    args = ["--mm-allow-private-media-hosts", "--api-key", KEY_ONE, "--api-key", KEY_TWO, "--admin-api-key", ADMIN,
            "--log-level", "info"]
    with running_stack(logs, gateway_args=args) as stack, media_origin() as origin:
        yield stack, origin, logs


@pytest.fixture(scope="module")
def stack(served: tuple[Stack, MediaOrigin, Path]) -> Stack:
    return served[0]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- the /v1 endpoints ------------------------------------------------------------------------------------

def _chat(stream: bool) -> dict:
    return {"model": DEFAULT_MODEL, "max_tokens": 2, "stream": stream,
            "messages": [{"role": "user", "content": "Say one word."}]}


def _responses(stream: bool) -> dict:
    return {"model": DEFAULT_MODEL, "max_output_tokens": 2, "stream": stream, "input": "Say one word."}


def _messages(stream: bool) -> dict:
    return {"model": DEFAULT_MODEL, "max_tokens": 2, "stream": stream,
            "messages": [{"role": "user", "content": "Say one word."}]}


#: (method, path, body or None, the lines one of which ends a streamed answer, or None)
ENDPOINTS = [
    ("POST", "/v1/chat/completions", _chat(False), None),
    ("POST", "/v1/chat/completions", _chat(True), ("data: [DONE]",)),
    ("POST", "/v1/responses", _responses(False), None),
    ("POST", "/v1/responses", _responses(True), ("event: response.completed", "event: response.incomplete")),
    ("POST", "/v1/messages", _messages(False), None),
    ("POST", "/v1/messages", _messages(True), ("event: message_stop",)),
    ("GET", "/v1/models", None, None),
]
ENDPOINT_IDS = [f"{m} {p}{' stream' if sse else ''}" for m, p, _, sse in ENDPOINTS]


def call(base: str, method: str, path: str, body: dict | None, headers: dict[str, str]) -> httpx.Response:
    return httpx.request(method, base + path, json=body, headers=headers, timeout=60)


def assert_unauthorized(resp: httpx.Response, path: str, challenge: str = "Bearer") -> None:
    """401 ``invalid_api_key`` in ``path``'s API shape, with ``WWW-Authenticate``, echoing no key."""
    assert resp.status_code == 401, resp.text
    assert resp.headers["X-SMG-Error-Code"] == "invalid_api_key"
    assert resp.headers["WWW-Authenticate"] == challenge
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
        assert set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == "authentication_error"
    else:
        assert set(body) == {"error"}
        assert set(body["error"]) == {"type", "code", "message", "param"}
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["code"] == "invalid_api_key"
        assert body["error"]["param"] is None
    for key in ALL_KEYS:
        assert key not in resp.text and key not in str(resp.headers)


def assert_answered(resp: httpx.Response, path: str, last_sse: Sse) -> None:
    assert resp.status_code == 200, resp.text
    if last_sse is None:
        body = resp.json()
        expected = {"/v1/chat/completions": "chat.completion", "/v1/responses": "response",
                    "/v1/messages": "message", "/v1/models": "list"}[path]
        assert body.get("object", body.get("type")) == expected
    else:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.text.splitlines() if line.startswith(("data:", "event:"))]
        assert set(last_sse) & set(lines), lines[-2:]


@pytest.mark.parametrize(("method", "path", "body", "last_sse"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_every_v1_endpoint_without_a_key_is_401_in_its_own_shape(stack: Stack, method: str, path: str,
                                                                 body: dict | None, last_sse: Sse) -> None:
    resp = call(stack.base, method, path, body, {})
    assert_unauthorized(resp, path)
    how = "x-api-key: <key> or Authorization: Bearer <key>" if path == "/v1/messages" \
        else "Authorization: Bearer <key>"
    message = resp.json()["error"]["message"]
    assert message == f"missing API key: send {how}"


WRONG_HEADERS = {
    "wrong key": bearer(WRONG),
    "the admin key": bearer(ADMIN),
    "a key's prefix": bearer(KEY_ONE[:-1]),
    "the key plus a byte": bearer(KEY_ONE + "x"),
    "another scheme": {"Authorization": f"Basic {KEY_ONE}"},
    "no scheme": {"Authorization": KEY_ONE},
    "empty bearer": {"Authorization": "Bearer"},
}


@pytest.mark.parametrize(("method", "path", "body", "last_sse"), ENDPOINTS, ids=ENDPOINT_IDS)
@pytest.mark.parametrize("headers", list(WRONG_HEADERS.values()), ids=list(WRONG_HEADERS))
def test_every_v1_endpoint_with_a_wrong_key_is_401(stack: Stack, method: str, path: str, body: dict | None,
                                                   last_sse: Sse, headers: dict[str, str]) -> None:
    assert_unauthorized(call(stack.base, method, path, body, headers), path)


@pytest.mark.parametrize(("method", "path", "body", "last_sse"), ENDPOINTS, ids=ENDPOINT_IDS)
@pytest.mark.parametrize("key", [KEY_ONE, KEY_TWO], ids=["first key", "second key"])
def test_every_v1_endpoint_with_a_right_key_answers(stack: Stack, method: str, path: str, body: dict | None,
                                                    last_sse: Sse, key: str) -> None:
    assert_answered(call(stack.base, method, path, body, bearer(key)), path, last_sse)


@pytest.mark.parametrize(("method", "path", "body", "last_sse"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_bearer_scheme_is_case_insensitive_as_vllm(stack: Stack, method: str, path: str, body: dict | None,
                                                   last_sse: Sse) -> None:
    headers = {"Authorization": f"bearer {KEY_TWO}"}
    assert_answered(call(stack.base, method, path, body, headers), path, last_sse)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_x_api_key_opens_v1_messages(stack: Stack, stream: bool) -> None:
    resp = call(stack.base, "POST", "/v1/messages", _messages(stream), {"x-api-key": KEY_ONE})
    assert_answered(resp, "/v1/messages", ("event: message_stop",) if stream else None)
    wrong = call(stack.base, "POST", "/v1/messages", _messages(stream), {"x-api-key": WRONG})
    assert_unauthorized(wrong, "/v1/messages")
    assert wrong.json()["error"]["message"] == "invalid API key"


@pytest.mark.parametrize(("method", "path", "body", "last_sse"),
                         [e for e in ENDPOINTS if not e[1].startswith("/v1/messages")],
                         ids=[i for i, e in zip(ENDPOINT_IDS, ENDPOINTS, strict=True)
                              if not e[1].startswith("/v1/messages")])
def test_x_api_key_is_not_a_key_on_the_openai_paths(stack: Stack, method: str, path: str, body: dict | None,
                                                    last_sse: Sse) -> None:
    assert_unauthorized(call(stack.base, method, path, body, {"x-api-key": KEY_ONE}), path)


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("GET", "/v1/nothing", 404, "not_found"),
    ("POST", "/v1/embeddings", 404, "not_found"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ("DELETE", "/v1/models", 405, "method_not_allowed"),
    ("POST", "/v1/messages/count_tokens", 404, "not_found"),
])
def test_any_v1_path_is_guarded_by_prefix_even_without_a_route(stack: Stack, method: str, path: str, status: int,
                                                               code: str) -> None:
    assert_unauthorized(call(stack.base, method, path, None, {}), path)
    resp = call(stack.base, method, path, None, bearer(KEY_ONE))
    assert resp.status_code == status
    assert resp.headers["X-SMG-Error-Code"] == code


# ---- the clients ------------------------------------------------------------------------------------------

def test_openai_client_with_the_key_gets_answers_and_with_another_an_authentication_error(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base + "/v1", api_key=KEY_ONE, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [DEFAULT_MODEL]
    chat = client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=2,
                                          messages=[{"role": "user", "content": "Say one word."}])
    assert chat.usage is not None and chat.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=2, stream=True,
                                                 messages=[{"role": "user", "content": "Say one word."}]))
    assert chunks[-1].choices[0].finish_reason is not None
    response = client.responses.create(model=DEFAULT_MODEL, input="Say one word.", max_output_tokens=2)
    assert response.status in ("completed", "incomplete")
    wrong = openai.OpenAI(base_url=stack.base + "/v1", api_key=WRONG, max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model=DEFAULT_MODEL, max_tokens=2,
                                      messages=[{"role": "user", "content": "Say one word."}])
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"


def test_anthropic_client_with_the_key_or_a_bearer_token_gets_answers(stack: Stack) -> None:
    messages: list[MessageParam] = [{"role": "user", "content": "Say one word."}]
    by_header = anthropic.Anthropic(base_url=stack.base, api_key=KEY_TWO, max_retries=0, timeout=60)
    out = by_header.messages.create(model=DEFAULT_MODEL, max_tokens=2, messages=messages)
    assert out.type == "message" and out.usage.output_tokens >= 1
    with by_header.messages.stream(model=DEFAULT_MODEL, max_tokens=2, messages=messages) as stream:
        assert stream.get_final_message().type == "message"
    by_token = anthropic.Anthropic(base_url=stack.base, api_key=None, auth_token=KEY_ONE, max_retries=0, timeout=60)
    assert by_token.messages.create(model=DEFAULT_MODEL, max_tokens=2, messages=messages).type == "message"
    wrong = anthropic.Anthropic(base_url=stack.base, api_key=WRONG, max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=DEFAULT_MODEL, max_tokens=2, messages=messages)
    assert caught.value.status_code == 401
    assert caught.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                            "message": "invalid API key"}}


# ---- nothing is read, planned or fetched before the key -----------------------------------------------------

def test_an_unauthenticated_request_with_media_urls_fetches_nothing(served: tuple[Stack, MediaOrigin, Path]) -> None:
    stack, origin, _ = served
    chat_url = origin.add("/keys/chat.png", png_bytes(), "image/png")
    responses_url = origin.add("/keys/responses.png", png_bytes(), "image/png")
    messages_url = origin.add("/keys/messages.png", png_bytes(), "image/png")
    requests = [
        ("/v1/chat/completions", {"model": DEFAULT_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": chat_url}}, {"type": "text", "text": "What is this?"}]}]}),
        ("/v1/responses", {"model": DEFAULT_MODEL, "max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": responses_url}, {"type": "input_text", "text": "What is this?"}]}]}),
        ("/v1/messages", {"model": DEFAULT_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": messages_url}},
            {"type": "text", "text": "What is this?"}]}]}),
    ]
    for path, body in requests:
        for headers in ({}, bearer(WRONG), bearer(ADMIN)):
            assert_unauthorized(call(stack.base, "POST", path, body, headers), path)
    hits = origin.settled()
    assert hits["/keys/chat.png"] == hits["/keys/responses.png"] == hits["/keys/messages.png"] == 0
    # the same request with the key does fetch: the origin would have seen the refused ones
    assert call(stack.base, "POST", *requests[0], bearer(KEY_ONE)).status_code == 200
    assert origin.settled()["/keys/chat.png"] == 1


def _raw_exchange(port: int, head: bytes, body_part: bytes) -> tuple[str, dict[str, str], bytes]:
    """Send ``head`` and ``body_part`` (not the rest of the body), then read until the server closes:
    (status line, headers, body).  A server waiting for the rest of the body would answer 408 only
    after ``--http-body-idle-timeout`` (30 s), inside this socket's 120 s."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(head + body_part)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:  # closed with our unread bytes in its buffer: the answer came first
            pass
    head_text, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head_text.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return status, headers, body


def test_a_huge_unauthenticated_body_is_refused_unread_and_the_connection_closed(stack: Stack) -> None:
    chunk = b"x" * 65536
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    status, headers, body = _raw_exchange(stack.gateway.port, chunked, b"10000\r\n" + chunk + b"\r\n")
    assert status.startswith("HTTP/1.1 401"), status
    assert headers["connection"] == "close"
    assert headers["x-smg-error-code"] == "invalid_api_key"
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    declared = (b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000000000\r\n\r\n")
    status, headers, body = _raw_exchange(stack.gateway.port, declared, chunk)
    assert status.startswith("HTTP/1.1 401"), status  # not 413: the key is checked before the body's size
    assert headers["connection"] == "close"
    assert json.loads(body)["error"]["type"] == "authentication_error"
    status, headers, _ = _raw_exchange(stack.gateway.port, declared[:-2] + f"Authorization: Bearer {KEY_ONE}\r\n\r\n"
                                       .encode(), chunk)
    assert status.startswith("HTTP/1.1 413"), status  # with the key, the body's size is what is refused


# ---- ops and admin on the gateway with both keys --------------------------------------------------------

@pytest.mark.parametrize("path", ["/health", "/metrics", "/workers"])
def test_ops_endpoints_are_open_without_protect_ops(stack: Stack, path: str) -> None:
    assert httpx.get(stack.base + path, timeout=30).status_code == 200


#: the admin API's routes (issue 25, item 5), guarded by path whether their routes exist yet or not
#: an id no worker has (worker ids are UUIDs: a malformed one is 400 ``invalid_request``)
NO_SUCH_WORKER = "/workers/00000000-0000-4000-8000-000000000000"
ADMIN_CALLS = [("POST", "/workers", {"url": "grpc://127.0.0.1:1"}), ("GET", NO_SUCH_WORKER, None),
               ("DELETE", NO_SUCH_WORKER, None)]
ADMIN_IDS = [f"{m} {p}" for m, p, _ in ADMIN_CALLS]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS, ids=ADMIN_IDS)
@pytest.mark.parametrize("headers", [{}, bearer(WRONG), bearer(KEY_ONE), bearer(KEY_TWO), {"x-api-key": ADMIN},
                                     {"Authorization": f"Basic {ADMIN}"}],
                         ids=["no key", "wrong key", "first api key", "second api key", "x-api-key", "basic"])
def test_admin_api_refuses_anything_but_the_admin_key(stack: Stack, method: str, path: str, body: dict | None,
                                                      headers: dict[str, str]) -> None:
    resp = call(stack.base, method, path, body, headers)
    assert_unauthorized(resp, path, challenge='Bearer realm="control-plane"')
    kind = "invalid admin API key" if "Authorization" in headers and "Basic" not in headers["Authorization"] \
        else "missing admin API key: send Authorization: Bearer <key>"
    assert resp.json()["error"]["message"] == kind


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS, ids=ADMIN_IDS)
def test_admin_key_reaches_the_admin_routes(stack: Stack, method: str, path: str, body: dict | None) -> None:
    resp = call(stack.base, method, path, {} if body else None, bearer(ADMIN))
    assert resp.status_code not in (401, 403), resp.text
    assert resp.headers.get("X-SMG-Error-Code") not in GUARD_CODES
    if path != "/workers":
        assert (resp.status_code, resp.headers["X-SMG-Error-Code"]) == (404, "worker_not_found")
    else:  # the route itself read the (empty) body: no url
        assert (resp.status_code, resp.headers["X-SMG-Error-Code"]) == (400, "invalid_request")


def test_keys_stay_out_of_metrics_and_logs(served: tuple[Stack, MediaOrigin, Path]) -> None:
    stack, _, logs = served
    for key in (WRONG, KEY_ONE):
        call(stack.base, "GET", "/v1/models", None, bearer(key))
    metrics_text = httpx.get(stack.base + "/metrics", timeout=30).text
    assert 'mmgate_errors_total{code="invalid_api_key"}' in metrics_text
    log_text = "".join(p.read_text(errors="replace") for p in logs.glob("gateway-*.log"))
    for key in ALL_KEYS:
        assert key not in metrics_text
        assert key not in log_text


# ---- --protect-ops and a gateway with no admin key ----------------------------------------------------------

def _in_thread_settings(**auth: object) -> Settings:
    return replace(settings_for(Path(bundle_path())), auth=AuthSettings(**auth))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def protected_ops() -> Iterator[str]:
    settings = _in_thread_settings(api_keys=(key_digest(KEY_ONE),), admin_keys=(key_digest(ADMIN),),
                                   protect_ops=True)
    with gateway_in_thread(settings, health_headers=bearer(KEY_ONE)) as base:
        yield base


OPS = [("GET", "/health"), ("HEAD", "/health"), ("GET", "/metrics"), ("GET", "/workers"), ("GET", "/docs"),
       ("GET", "/openapi.json"), ("GET", "/no-such-page")]


@pytest.mark.parametrize(("method", "path"), OPS, ids=[f"{m} {p}" for m, p in OPS])
def test_protect_ops_needs_the_api_key_or_the_admin_key_on_every_other_path(protected_ops: str, method: str,
                                                                           path: str) -> None:
    for headers in ({}, bearer(WRONG), {"x-api-key": KEY_ONE}):
        resp = httpx.request(method, protected_ops + path, headers=headers, timeout=30)
        assert resp.status_code == 401
        assert resp.headers["X-SMG-Error-Code"] == "invalid_api_key"
        if method == "GET":
            assert_unauthorized(resp, path)
    for key in (KEY_ONE, ADMIN):
        resp = httpx.request(method, protected_ops + path, headers=bearer(key), timeout=30)
        assert resp.headers.get("X-SMG-Error-Code") not in GUARD_CODES
        # /health is 503 here (its worker's port is closed); an unknown page is the framework's 404, and
        # HEAD the framework's 405 (FastAPI's GET routes take no HEAD)
        expected = 405 if method == "HEAD" else {"/health": 503, "/no-such-page": 404}.get(path, 200)
        assert resp.status_code == expected


@pytest.fixture(scope="module")
def keyless() -> Iterator[str]:
    with gateway_in_thread(_in_thread_settings()) as base:
        yield base


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS, ids=ADMIN_IDS)
def test_without_an_admin_key_the_admin_api_is_403_whatever_is_sent(keyless: str, method: str, path: str,
                                                                     body: dict | None) -> None:
    for headers in ({}, bearer(ADMIN), bearer(KEY_ONE)):
        resp = call(keyless, method, path, body, headers)
        assert resp.status_code == 403
        assert resp.headers["X-SMG-Error-Code"] == "admin_api_disabled"
        assert resp.json() == {"error": {"type": "invalid_request_error", "code": "admin_api_disabled",
                                         "message": "the admin API is off: start the gateway with --admin-api-key",
                                         "param": None}}


def test_without_keys_v1_and_ops_stay_open(keyless: str) -> None:
    assert httpx.get(keyless + "/v1/models", timeout=30).json()["data"][0]["id"] == DEFAULT_MODEL
    assert httpx.get(keyless + "/workers", timeout=30).status_code == 200
    assert httpx.get(keyless + "/metrics", timeout=30).status_code == 200


# ---- the parts: settings, comparison, the guard's WebSocket refusal -----------------------------------------

MODEL_ARGS = ["--model", "org/model"]


def test_keys_from_flags_repeated_or_listed_and_from_the_environment() -> None:
    by_flags = parse_settings([*MODEL_ARGS, "--api-key", "a", "b", "--api-key", "c", "--admin-api-key", "z"], {})
    assert by_flags.auth.api_keys == tuple(key_digest(k) for k in "abc")
    assert by_flags.auth.admin_keys == (key_digest("z"),)
    assert by_flags.auth.protect_ops is False
    by_env = parse_settings(MODEL_ARGS, {"MMGATE_API_KEY": "a, b", "MMGATE_ADMIN_API_KEY": "z",
                                         "MMGATE_PROTECT_OPS": "1"})
    assert by_env.auth == AuthSettings(api_keys=(key_digest("a"), key_digest("b")), admin_keys=(key_digest("z"),),
                                       protect_ops=True)
    flag_wins = parse_settings([*MODEL_ARGS, "--api-key", "f"], {"MMGATE_API_KEY": "e"})
    assert flag_wins.auth.api_keys == (key_digest("f"),)
    assert parse_settings(MODEL_ARGS, {}).auth == AuthSettings()


def test_settings_hold_digests_only_and_never_show_a_key() -> None:
    settings = parse_settings([*MODEL_ARGS, "--api-key", KEY_ONE, "--admin-api-key", ADMIN], {})
    assert KEY_ONE not in repr(settings) and ADMIN not in repr(settings)
    assert key_digest(KEY_ONE).hex() not in repr(settings)
    assert settings.auth.api_keys == (hashlib.sha256(KEY_ONE.encode()).digest(),)


@pytest.mark.parametrize(("argv", "message"), [
    (["--api-key", ""], "--api-key and --admin-api-key must not be empty"),
    (["--api-key", KEY_ONE, "--admin-api-key", KEY_ONE], "a key may not be both an --api-key and an --admin-api-key"),
    (["--protect-ops"], "--protect-ops needs an --api-key or an --admin-api-key"),
])
def test_unusable_key_settings_stop_start_up_without_quoting_a_key(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_settings([*MODEL_ARGS, *argv], {})
    assert str(caught.value) == message


def test_serve_help_lists_the_key_options() -> None:
    text = build_parser().format_help()
    assert "API keys:" in text
    for flag, env in (("--api-key", "MMGATE_API_KEY"), ("--admin-api-key", "MMGATE_ADMIN_API_KEY"),
                      ("--protect-ops", "MMGATE_PROTECT_OPS")):
        assert flag in text and env in text


def test_every_configured_key_is_compared_even_after_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    import mmgate.api.keys as keys

    calls: list[tuple[bytes, bytes]] = []
    real = keys.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(keys.hmac, "compare_digest", counting)
    digests = [key_digest(k) for k in (KEY_ONE, KEY_TWO, ADMIN)]
    assert key_matches([KEY_ONE.encode()], digests) is True  # matches the first of three
    assert key_matches([WRONG.encode(), KEY_TWO.encode()], digests) is True
    assert key_matches([WRONG.encode()], digests) is False
    assert len(calls) == 3 + 6 + 3
    assert all(len(a) == len(b) == 32 for a, b in calls)  # digests: the presented key's length never shows


def test_a_websocket_on_a_guarded_path_is_closed_before_the_app_sees_it() -> None:
    reached: list[str] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        reached.append(scope["path"])

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    guard = KeyGuard(app, AuthSettings(api_keys=(key_digest(KEY_ONE),)), render=None)  # type: ignore[arg-type]
    scope = {"type": "websocket", "path": "/v1/realtime", "headers": [(b"authorization", b"Bearer " + WRONG.encode())]}
    asyncio.run(guard(scope, None, send))  # type: ignore[arg-type]
    assert sent == [{"type": "websocket.close", "code": 1008}] and reached == []
    right = {**scope, "headers": [(b"authorization", b"Bearer " + KEY_ONE.encode())]}
    asyncio.run(guard(right, None, send))  # type: ignore[arg-type]
    assert reached == ["/v1/realtime"]

"""Every case of the shared edge-case corpus through the HTTP API of a running gateway.

Each case is one chat request (``../shared/cases/README.md``): its media are
sent as ``data:`` URLs, served by the scripted loopback origin, or used
verbatim, as the case's ``transport`` says.  The answer is judged against
``expected`` (outcome, tensors on the wire to the reference engine, decoded
pixels) and every ``never`` (no 500, no hang, no worker crash, no payload
echoed into the answer or the gateway log, no truncated stream, no
connection to a blocked address).  Cases that need what mmgate does not
serve yet are xfail(strict) with the reason, and counted as pending in the
summary printed at the end of the run (see ``conftest.py``).
"""

from __future__ import annotations

import copy
import json
import re
import time
from typing import Any

import httpx
import pytest

from tests.corpus.cases import (
    data_url,
    group_of,
    load_corpus,
    missing_files_reason,
    needs_video,
    pending_reason,
)
from tests.corpus.conftest import (
    FETCH_TOTAL_TIMEOUT_S,
    CorpusStack,
    Profile,
    record_pending,
)
from tests.corpus.judge import (
    STATUS_OF_OUTCOME,
    Answer,
    check_decoded_pixels,
    check_ok_crop_image,
    check_ok_image,
    check_ok_video,
    check_status,
    check_stream,
    check_timeout,
)
from tests.corpus.stack import ALLOWED_TEST_HOST, CROP_PROFILES
from tests.media.netfakes import loopback_listener
from tests.media.origin import Behavior

CLIENT_TIMEOUT_S = 60.0  # a request that has not answered by then "hangs"
_FILE = re.compile(r"\{\{file:([^}]+)\}\}")
_LITERAL = re.compile(r"\{\{literal:([^}]+)\}\}")


def _params() -> list[Any]:
    params = []
    for case in load_corpus().cases:
        reason = pending_reason(case)
        marks = []
        if reason is not None:
            record_pending(reason, case["id"])
            marks.append(pytest.mark.xfail(strict=True, reason=f"pending: {reason}"))
        params.append(pytest.param(case, id=case["id"], marks=marks))
    return params


def _behavior(case: dict[str, Any], body: bytes, path: str) -> Behavior:
    """The scripted origin's answer for a case's ``server_behavior``."""
    sb = case.get("server_behavior", {})
    if sb.get("redirect_to_self"):
        return Behavior(status=302, redirect_to=path)
    return Behavior(body=body, status=int(sb.get("status", 200)), content_type=sb.get("content_type", "image/png"),
                    stall_s=float(sb.get("stall_seconds", 0)), bytes_per_second=float(sb.get("bytes_per_second", 0)),
                    pad_to=int(sb.get("pad_body_to_bytes", 0)))


def materialize(case: dict[str, Any], stack: CorpusStack) -> tuple[dict[str, Any], list[str], dict[str, bytes]]:
    """The request body, payload fragments that must never be echoed, and the media bytes by file name."""
    corpus = load_corpus()
    request = copy.deepcopy(case["request"])
    fragments: list[str] = []
    media: dict[str, bytes] = {}
    transport = case.get("transport", "data_url")

    def url_for(url: str) -> str:
        if (m := _FILE.fullmatch(url)) is not None:
            name = m.group(1)
            media[name] = corpus.file(name)
            if transport == "http":
                path = f"/{case['id']}/{name}"
                stack.origin.add(path, _behavior(case, media[name], path))
                return stack.origin.url(path)
            url = data_url(name, media[name])
        elif (m := _LITERAL.fullmatch(url)) is not None:
            url = (corpus.root / "files" / m.group(1)).read_text()
        else:
            url = url.replace("{PORT}", str(stack.origin.port)).replace("{ALLOWED_TEST_HOST}", ALLOWED_TEST_HOST)
        payload = url.partition(",")[2] if url[:5].lower() == "data:" else ""
        if len(payload) > 64:
            fragments.append(payload[len(payload) // 2: len(payload) // 2 + 32])
        return url

    for message in request["messages"]:
        for part in message.get("content") or []:
            for key in ("image_url", "video_url"):
                if key in part:
                    part[key]["url"] = url_for(part[key]["url"])
    return request, fragments, media


def _send(base: str, body: dict[str, Any]) -> tuple[httpx.Response | None, float, str | None]:
    start = time.monotonic()
    try:
        resp = httpx.post(base + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S)
        return resp, time.monotonic() - start, None
    except httpx.HTTPError as exc:
        return None, time.monotonic() - start, f"{type(exc).__name__}"


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _check_never(case: dict[str, Any], answer: Answer, profile: Profile | None, stack: CorpusStack) -> None:
    never = case["expected"].get("never", [])
    resp = answer.response
    assert answer.error is None, f"{case['id']}: no answer ({answer.error}): a hang or a dropped connection"
    assert resp is not None and resp.status_code != 500, f"{case['id']}: HTTP 500: {resp.text[:300] if resp else ''}"
    if "http_200" in never:
        assert resp.status_code != 200, f"{case['id']}: a refused target answered 200"
    if "file contents echoed" in never:
        assert "root:" not in resp.text
    if profile is not None:
        assert profile.engine.proc.poll() is None, f"{case['id']}: the engine died"
        assert profile.gateway.proc.poll() is None, f"{case['id']}: the gateway died"
        health = httpx.get(profile.base + "/health", timeout=10).json()
        assert health["healthy_workers"] >= 1, f"{case['id']}: no healthy worker after the case"
        log = profile.gateway.log_tail(200_000)
        assert "Traceback" not in log and "internal error" not in log, f"{case['id']}: gateway log:\n{log[-2000:]}"
        for fragment in answer.payload_fragments:
            assert fragment not in log, f"{case['id']}: payload echoed into the gateway log"
    check_stream(case, answer)


@pytest.mark.parametrize("case", _params())
def test_corpus_case(case: dict[str, Any], corpus_stack: CorpusStack) -> None:
    if (missing := missing_files_reason(case)) is not None:
        pytest.fail(missing)
    stack = corpus_stack
    exp = case["expected"]
    if case.get("transport") == "unit":
        _judge_unit(case)
        return
    ssrf = case.get("transport") == "url_as_is"
    profile = None if ssrf else stack.profiles[case["model_profile"]]
    request, fragments, media = materialize(case, stack)
    served = stack.profiles[case["model_profile"]].served_name
    body = {"model": served, "max_tokens": 2, "temperature": 0, **request}
    base = stack.ssrf_base if ssrf else profile.base  # type: ignore[union-attr]

    rss_before = _rss_mb(profile.gateway.proc.pid) if profile and "max_rss_growth_mb" in exp else 0.0
    hits_before = sum(stack.origin.hits.values())
    resp, elapsed, error = _send(base, body)
    answer = Answer(response=resp, elapsed_s=elapsed, error=error, payload_fragments=fragments)
    if resp is not None and resp.status_code == 200 and profile is not None:
        answer.wire = profile.proxy.get(resp.headers.get("X-Request-Id", ""))
    if "truncated_sse_stream" in exp.get("never", []):
        stream_resp, _, _ = _send(base, {**body, "stream": True})
        answer.stream_text = stream_resp.text if stream_resp is not None else None
    _check_never(case, answer, profile, stack)
    assert resp is not None

    outcome = exp.get("outcome")
    if ssrf:
        _judge_ssrf(case, answer, stack, hits_before)
    elif outcome in ("ok", "ok_or_http_400"):  # mmgate's policy accepts every lenient variant: judged as ok
        _judge_ok(case, answer, stack, media)
    elif outcome == "timeout_error":
        check_timeout(case, answer, FETCH_TOTAL_TIMEOUT_S)
    elif outcome in STATUS_OF_OUTCOME:
        check_status(case, answer, STATUS_OF_OUTCOME[outcome])
    elif outcome in ("http_4xx", "http_4xx_or_502_503"):
        check_status(case, answer, set(exp["allowed"]))
    else:
        raise AssertionError(f"{case['id']}: outcome {outcome!r} has no judge")
    if "message_mentions" in exp:
        assert exp["message_mentions"] in resp.json()["error"]["message"].lower()
    if "max_rss_growth_mb" in exp:
        assert profile is not None
        assert _rss_mb(profile.gateway.proc.pid) - rss_before < exp["max_rss_growth_mb"]
    if "max_seconds" in exp:
        assert elapsed < exp["max_seconds"], f"{case['id']}: took {elapsed:.2f}s"
    if "stop_reading_after" in exp:
        time.sleep(0.3)
        pad = case["server_behavior"]["pad_body_to_bytes"]
        assert sum(stack.origin.bytes_sent.values()) < pad, "the gateway read the whole oversized body"


def _judge_ok(case: dict[str, Any], answer: Answer, stack: CorpusStack, media: dict[str, bytes]) -> None:
    exp = case["expected"]
    profile_values = load_corpus().profiles[case["model_profile"]]
    if needs_video(case):
        check_ok_video(case, answer)
        return
    same_as = exp.get("same_pixels_as")
    same_bytes = load_corpus().file(same_as) if same_as else None
    if case["model_profile"] in CROP_PROFILES:
        _judge_ok_crop(case, answer, stack, same_bytes)
    else:
        images = [n for n in media if not n.endswith(".txt")]
        image_bytes = media[images[0]] if images else None
        check_ok_image(case, answer, image_bytes, profile_values["patch_size"],
                       stack.reference_processor(case["model_profile"]), same_bytes)
    if same_bytes is not None and "decoded_rgb_at" in exp:
        check_decoded_pixels(case, same_bytes)


def _judge_ok_crop(case: dict[str, Any], answer: Answer, stack: CorpusStack, same_bytes: bytes | None) -> None:
    """A LLaVA-1.5 profile case: one crop and one ``<image>`` run per image part (``image_token_index``
    of the profile bundle's config.json), pixels as the bundle's ``CLIPImageProcessor``."""
    profile = case["model_profile"]
    image_token_id = int(json.loads((stack.profiles[profile].bundle / "config.json").read_text())["image_token_index"])
    parts = [p for m in case["request"]["messages"] for p in (m.get("content") or []) if isinstance(p, dict)]
    files = [_FILE.fullmatch(p["image_url"]["url"]) for p in parts if p.get("type") == "image_url"]
    sent = [load_corpus().file(m.group(1)) for m in files if m is not None] if all(files) else []
    check_ok_crop_image(case, answer, len(files), sent, load_corpus().profiles[profile],
                        stack.reference_processor(profile), image_token_id, same_bytes)


def _judge_unit(case: dict[str, Any]) -> None:
    """Temporal padding of mmgate's video patchify: N frames -> a multiple of T, padded with the last frame."""
    import numpy as np

    from mmgate.models.video_pixels import patchify_video

    req, exp = case["request"], case["expected"]
    assert req["calc"] == "padded_num_frames"
    n, t, patch, merge = req["num_frames"], req["temporal_patch_size"], 14, 2
    frames = np.broadcast_to(np.arange(n, dtype=np.float32)[:, None, None, None], (n, patch * merge, patch * merge, 3))
    rows = patchify_video(np.ascontiguousarray(frames), patch, merge, t)
    grid_t = rows.shape[0] // (merge * merge)
    assert grid_t == exp["grid_t"] and grid_t * t == exp["padded_num_frames"] != exp["wrong_value_seen_in_bug"]
    last_group = rows[-1].reshape(3, t, patch, patch)[0, :, 0, 0].tolist()  # frame index held by each T slot
    assert last_group == [float(min(i, n - 1)) for i in range((grid_t - 1) * t, grid_t * t)]


def _judge_ssrf(case: dict[str, Any], answer: Answer, stack: CorpusStack, hits_before: int) -> None:
    """Refused with 400 under the default policy; no connection reached the loopback target."""
    resp = answer.response
    assert resp is not None
    check_status(case, answer, STATUS_OF_OUTCOME[case["expected"]["outcome"]])
    blocked_hits = sum(n for path, n in stack.origin.settled().items() if path != "/redirect")
    assert blocked_hits == 0, f"{case['id']}: the blocked loopback target was contacted"
    assert stack.ssrf_backend.refused == [], f"{case['id']}: a non-routed address was dialled"
    url = json.dumps(case["request"])
    if "/redirect" in url:
        assert stack.origin.hits["/redirect"] >= 1, f"{case['id']}: the first (allowed) hop was not even made"


@pytest.fixture(scope="module", autouse=True)
def _ipv6_loopback_guard(corpus_stack: CorpusStack) -> Any:
    """A listener on ``[::1]`` at the origin's port: the IPv6 loopback SSRF form must not reach it either."""
    try:
        ctx = loopback_listener("::1", corpus_stack.origin.port)
        listener = ctx.__enter__()
    except OSError:
        yield
        return
    yield
    accepted = listener.settled()
    ctx.__exit__(None, None, None)
    assert accepted == 0, "a connection reached [::1]"


def test_corpus_groups_are_all_collected() -> None:
    groups = {group_of(c["id"]) for c in load_corpus().cases}
    assert {"BH-01", "BH-03", "BH-07", "BH-09", "BH-10", "BH-11"} <= groups

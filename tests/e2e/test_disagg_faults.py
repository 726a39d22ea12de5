"""Fault soak of disaggregated serving through the gateway (issue 12, acceptance "Faults").

Real parts only: a gateway process (``mmgate serve --pd-disaggregation`` / ``--epd-disaggregation``) and the
reference engines in this process (SGLang-wire and TokenSpeed-wire prefill/decode pairs, the TokenSpeed
encode/prefill/decode trio), each engine's gRPC port and each prefill/encode engine's bootstrap (handoff)
port behind a loopback :class:`~tests.e2e.fault_proxy.FaultProxy`.  Nothing in ``src/`` is patched: faults
are network faults on those links and engines stopped (``RunningEngine.stop(grace=0)``) and restarted
behind the same proxy address.

What the soak shows, per request (a few hundred, 6 in flight, faults drawn by a seeded RNG):

* the answer is 200 with exactly the completion tokens the same stack gives without faults (greedy, EOS
  ignored; compared token by token through ``logprobs`` bytes, streamed or not), or a retryable 503
  (``engine_unavailable`` / ``no_healthy_worker``, ``Retry-After`` set; in a stream already started: an
  ``error`` event with such a code), or -- for a request the engine refuses (a ``logit_bias`` id outside
  the model's vocabulary, "prefill error") -- the engine's own 400 ``engine_rejected``;
* no request takes longer than :data:`BOUND_S` (the engines wait at most :data:`HANDOFF_WAIT_S` for a
  handoff; the client's timeout is longer than the bound, so a hang shows as a failure, not a skip).

After the soak: no ``/dev/shm/mmgate-<gateway pid>-*`` segment (the TokenSpeed stacks send every tensor
through shared memory, ``--multimodal-tensor-transport shm --multimodal-shm-min-bytes 0``), the gateway's
``/health`` answers with every worker healthy, no request counted in flight (``/workers``,
``mmgate_active_requests``) and no media bytes held (``mmgate_mm_inflight_bytes``), every prefill / encode
engine's handoff store empty once unclaimed payloads expire (``--handoff-timeout``
:data:`HANDOFF_TIMEOUT_S`), no request left running on any engine, the gateway's RSS within a generous
bound of its size after warm-up, and a clean request answered with the right tokens.

Targeted, deterministic cases: an engine killed mid-request at each point of the request's life (the
prefill during its RPC and while the decode pulls its KV; the decode while pulling; the encoder during its
``Encode`` RPC and while the prefill pulls its embeddings), the decode leg lost mid-stream, the prefill
refusing a request (the engine's 4xx; its failed room expires), and a link that goes silent without closing
(the proxy frozen: a PD decode leg before the request and mid-stream, and a single worker while another one
serves), which the gateway's HTTP/2 keepalive finds: the stacks run with a short one (:data:`KEEPALIVE_ARGS`).
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from mmgate.engines.base import Role, Wire
from mmgate.errors import ERROR_TABLE, ErrorCode
from mmgate.cli.launch import Child, start_gateway, wait_http_health
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from tests.conftest import bundle_dir
from tests.e2e.fault_proxy import Fault, FaultProxy
from tests.e2e.test_disaggregation import QWEN2_5, QWEN3, _png, _segments

#: an unclaimed KV cache / embedding is freed by its engine after this long
HANDOFF_TIMEOUT_S = 3.0
#: a decode (or EPD prefill) engine waits this long for its room to be published
HANDOFF_WAIT_S = 6.0
#: no request may take longer (a hang); the client waits longer than this, so a hang is seen as one
BOUND_S = 30.0
CLIENT_TIMEOUT_S = 60.0
#: the codes a fault may give a request that was otherwise fine (retryable 503s of the one error table)
RETRYABLE = frozenset({ErrorCode.ENGINE_UNAVAILABLE.value, ErrorCode.NO_HEALTHY_WORKER.value})
#: a token id outside the vocabulary: the gateway passes ``logit_bias`` on, the engine refuses it (its own 400)
BAD_LOGIT_BIAS = {"999999": 1}
MAX_TOKENS = 3
#: how long a soak client pauses after a retryable 503 before its next request
RETRY_PAUSE_S = 0.25
#: the gateway's worker probe interval in these stacks (``--worker-health-interval``)
HEALTH_INTERVAL_S = 0.5
#: the gateway's engine keepalive in these stacks (``--engine-keepalive-*``; SMG's 30 s + 10 s by default): a link
#: that goes silent without closing is found within about their sum
KEEPALIVE_INTERVAL_S = 2.0
KEEPALIVE_TIMEOUT_S = 2.0
KEEPALIVE_ARGS = ["--engine-keepalive-interval", str(KEEPALIVE_INTERVAL_S),
                  "--engine-keepalive-timeout", str(KEEPALIVE_TIMEOUT_S)]
#: a request over a silent link ends within this: the keepalive's detection plus slack for a busy machine
SILENT_BOUND_S = KEEPALIVE_INTERVAL_S + KEEPALIVE_TIMEOUT_S + 6.0


# ---- the stack: engines behind proxies, one gateway ---------------------------------------------------

@dataclass
class Proxied:
    """One engine behind its fault proxies (gRPC; bootstrap for the prefill and encode roles)."""

    config: EngineConfig
    engine: RunningEngine | None
    grpc: FaultProxy
    boot: FaultProxy | None
    restarts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def start(cls, config: EngineConfig) -> Proxied:
        engine = start_engine(config)
        boot = FaultProxy(engine.bootstrap_port, f"{config.role.value}-boot") if engine.bootstrap_port else None
        return cls(config, engine, FaultProxy(engine.port, f"{config.role.value}-grpc"), boot)

    @property
    def role(self) -> Role:
        return self.config.role

    def kill(self) -> None:
        """Stop the engine at once: in-flight RPCs cancelled, its handoff listener closed."""
        with self.lock:
            engine, self.engine = self.engine, None
        if engine is not None:
            engine.stop(grace=0)

    def restart(self) -> None:
        """Start a fresh engine (same model, same seeded weights) behind the same proxies."""
        with self.lock:
            assert self.engine is None, "kill first"
            engine = start_engine(self.config)
            self.grpc.retarget(engine.port)
            if self.boot is not None:
                self.boot.retarget(engine.bootstrap_port)
            self.engine = engine
            self.restarts += 1

    def proxies(self) -> list[FaultProxy]:
        return [self.grpc] + ([self.boot] if self.boot is not None else [])

    def stop(self) -> None:
        self.kill()
        for proxy in self.proxies():
            proxy.close()


class FaultStack:
    """A gateway over proxied engines: PD on ``wire`` or, with ``epd``, the TokenSpeed EPD trio."""

    def __init__(self, model: str, wire: Wire, epd: bool, shm: bool, log_dir: Path) -> None:
        self.model, self.wire, self.epd, self.shm = model, wire, epd, shm
        roles = [Role.PREFILL, Role.DECODE] + ([Role.ENCODE] if epd else [])
        self.legs: dict[Role, Proxied] = {}
        self.gateway: Child | None = None
        try:
            for role in roles:
                self.legs[role] = Proxied.start(EngineConfig(
                    model=bundle_dir(model), port=0, wire=wire, role=role,
                    handoff_timeout_s=HANDOFF_TIMEOUT_S, handoff_wait_s=HANDOFF_WAIT_S))
            prefill, decode = self.legs[Role.PREFILL], self.legs[Role.DECODE]
            assert prefill.boot is not None
            extra = ["--served-model-name", model, "--epd-disaggregation" if epd else "--pd-disaggregation",
                     "--prefill", f"grpc://127.0.0.1:{prefill.grpc.port}", str(prefill.boot.port),
                     "--decode", f"grpc://127.0.0.1:{decode.grpc.port}",
                     "--worker-health-interval", str(HEALTH_INTERVAL_S), *KEEPALIVE_ARGS]
            if epd:
                encode = self.legs[Role.ENCODE]
                assert encode.boot is not None
                extra += ["--encode", f"grpc://127.0.0.1:{encode.grpc.port}", str(encode.boot.port)]
            if shm:
                extra += ["--multimodal-tensor-transport", "shm", "--multimodal-shm-min-bytes", "0"]
            if wire is Wire.SGLANG:  # Qwen-VL images on SGLang need the opt-in (docs/engines-sglang.md, "M-RoPE positions")
                extra.append("--sglang-allow-mrope-media")
            self.gateway = start_gateway(str(bundle_dir(model)), [], extra=extra, log_dir=log_dir)
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{self.gateway.port}"
        self.client = httpx.Client(timeout=CLIENT_TIMEOUT_S, limits=httpx.Limits(max_connections=32))
        self.expected = {i: _answer(self.post(body)) for i, body in enumerate(self.bodies())}

    @property
    def pid(self) -> int:
        assert self.gateway is not None
        return self.gateway.proc.pid

    def bodies(self) -> list[dict[str, Any]]:
        """The request variants of the soak: one or two tiny images, and text only."""
        shapes: list[list[tuple[int, int]]] = [[(28, 28)], [(40, 60)], [(60, 30), (28, 44)], [(32, 32)], []]
        out = []
        for v, sizes in enumerate(shapes):
            parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": _png(h, w, 100 * v + k)}}
                                           for k, (h, w) in enumerate(sizes)]
            out.append({"model": self.model, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                        "logprobs": True,
                        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": f"Item {v}?"}]}]})
        return out

    def post(self, body: dict[str, Any]) -> httpx.Response:
        return self.client.post(f"{self.url}/v1/chat/completions", json=body)

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        assert self.gateway is not None
        wait_http_health(self.gateway, timeout_s=timeout_s, want_workers=len(self.legs))

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        for leg in self.legs.values():
            leg.stop()
        if hasattr(self, "client"):
            self.client.close()


def _answer(resp: httpx.Response) -> list[str]:
    """The completion's tokens (their bytes, as hex) of a 200 answer."""
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    return [bytes(t["bytes"]).hex() for t in content]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, FaultStack]]:
    """The stacks, started on first use and stopped at the end of the module."""
    made: dict[str, FaultStack] = {}
    yield made
    for stack in made.values():
        stack.stop()


STACKS: dict[str, tuple[str, Wire, bool, bool]] = {  # name -> (model, wire, epd, shm)
    "pd-sglang": (QWEN2_5, Wire.SGLANG, False, False),  # SGLang's TensorData cannot name a segment
    "pd-tokenspeed-shm": (QWEN3, Wire.TOKENSPEED, False, True),
    "epd-tokenspeed-shm": (QWEN3, Wire.TOKENSPEED, True, True),
}


def _stack(stacks: dict[str, FaultStack], name: str, tmp_path_factory: pytest.TempPathFactory) -> FaultStack:
    if name not in stacks:
        model, wire, epd, shm = STACKS[name]
        stacks[name] = FaultStack(model, wire, epd, shm, tmp_path_factory.mktemp(f"logs-{name}"))
    return stacks[name]


# ---- one request, classified --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Outcome:
    """What one request got: ``kind`` ``ok`` | ``retryable`` | ``rejected`` | ``wrong``."""

    kind: str
    status: int
    code: str
    seconds: float
    detail: str = ""


def _stream_answer(resp: httpx.Response) -> tuple[list[str], dict[str, Any] | None, bool]:
    """(token bytes as hex, the error event if any, whether ``[DONE]`` ended it) of an SSE answer."""
    tokens: list[str] = []
    error = None
    done = False
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
            continue
        for choice in event.get("choices", []):
            for t in (choice.get("logprobs") or {}).get("content") or []:
                tokens.append(bytes(t["bytes"]).hex())
    return tokens, error, done


def send(stack: FaultStack, body: dict[str, Any], want: list[str] | None, stream: bool) -> Outcome:
    """Send ``body``; classify the answer (``want``: the right tokens; None: the engine must refuse it)."""
    started = time.monotonic()
    try:
        if stream:
            with stack.client.stream("POST", f"{stack.url}/v1/chat/completions",
                                     json={**body, "stream": True}) as resp:
                if resp.status_code != 200:
                    resp.read()
                    return _classify(resp, want, time.monotonic() - started)
                tokens, error, done = _stream_answer(resp)
        else:
            resp = stack.post(body)
            return _classify(resp, want, time.monotonic() - started)
    except httpx.HTTPError as exc:
        return Outcome("wrong", 0, "", time.monotonic() - started, f"transport: {type(exc).__name__} {exc}")
    seconds = time.monotonic() - started
    if not done:
        return Outcome("wrong", 200, "", seconds, "stream ended without [DONE]")
    if error is not None:
        code = str(error.get("code"))
        if code in RETRYABLE:
            return Outcome("retryable", 200, code, seconds, "mid-stream")
        return Outcome("wrong", 200, code, seconds, f"mid-stream error {error}")
    if want is not None and tokens == want:
        return Outcome("ok", 200, "", seconds)
    return Outcome("wrong", 200, "", seconds, f"tokens {tokens} != {want}")


def _classify(resp: httpx.Response, want: list[str] | None, seconds: float) -> Outcome:
    code = resp.headers.get("X-SMG-Error-Code", "")
    if resp.status_code == 200:
        if want is not None and _answer(resp) == want:
            return Outcome("ok", 200, "", seconds)
        return Outcome("wrong", 200, "", seconds, f"tokens {_answer(resp)} != {want}")
    body_code = ""
    try:
        body_code = str(resp.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        pass
    if (resp.status_code == 503 and code in RETRYABLE and body_code == code and ERROR_TABLE[ErrorCode(code)].retryable
            and resp.headers.get("Retry-After")):
        return Outcome("retryable", 503, code, seconds)
    if want is None and resp.status_code == 400 and code == ErrorCode.ENGINE_REJECTED.value == body_code:
        return Outcome("rejected", 400, code, seconds)
    return Outcome("wrong", resp.status_code, code, seconds, resp.text[:300])


# ---- after a fault: nothing left behind ----------------------------------------------------------------

def _poll(check: Callable[[], bool], timeout_s: float, every_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _metric(text: str, name: str, labels: str = "") -> float:
    """The sum of metric ``name``'s samples whose labels contain ``labels``."""
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE):
        if labels in (match.group(1) or ""):
            total += float(match.group(2))
    return total


def _handoff_rooms(stack: FaultStack) -> dict[str, int]:
    rooms = {}
    for role, leg in stack.legs.items():
        engine = leg.engine
        if engine is not None and engine.core.handoff is not None:
            rooms[role.value] = engine.core.handoff.store.rooms()
    return rooms


def _engine_requests(stack: FaultStack) -> dict[str, tuple[int, int]]:
    return {role.value: leg.engine.core.counts() for role, leg in stack.legs.items() if leg.engine is not None}


def recover(stack: FaultStack) -> None:
    """Faults disarmed, every engine running, and the stack serving again.

    A restarted engine's channel reconnects with gRPC's backoff and the gateway's next probe marks it healthy:
    until then a request may get a retryable 503 (a client honouring ``Retry-After`` tries again); the stack
    must come back within a few seconds.
    """
    for leg in stack.legs.values():
        for proxy in leg.proxies():
            proxy.disarm()
        if leg.engine is None:
            leg.restart()
    stack.wait_healthy()
    recovered = [send(stack, stack.bodies()[0], stack.expected[0], stream=False)]
    while recovered[-1].kind == "retryable" and len(recovered) < 20:
        time.sleep(1.0)
        recovered.append(send(stack, stack.bodies()[0], stack.expected[0], stream=False))
    assert recovered[-1].kind == "ok", recovered


def assert_clean(stack: FaultStack) -> None:
    """Everything a failed request could leave behind is gone, and the stack serves a clean request right."""
    recover(stack)
    assert _poll(lambda: not _segments(stack.pid), 5.0), f"shm segments left: {sorted(_segments(stack.pid))}"
    assert _poll(lambda: all(w["in_flight"] == 0 for w in stack.client.get(f"{stack.url}/workers").json()["workers"]),
                 5.0), stack.client.get(f"{stack.url}/workers").json()
    text = stack.client.get(f"{stack.url}/metrics").text
    assert _metric(text, "mmgate_active_requests") == 0
    assert _metric(text, "mmgate_mm_inflight_bytes") == 0
    # unclaimed KV / embeddings and failed rooms expire; nothing is pending for ever
    assert _poll(lambda: not any(_handoff_rooms(stack).values()), HANDOFF_TIMEOUT_S + 10.0), _handoff_rooms(stack)
    assert _poll(lambda: all(c == (0, 0) for c in _engine_requests(stack).values()), 10.0), _engine_requests(stack)
    assert _answer(stack.post(stack.bodies()[0])) == stack.expected[0]
    assert _answer(stack.post(stack.bodies()[2])) == stack.expected[2]


# ---- the soak ------------------------------------------------------------------------------------------

#: per-request faults on a bootstrap link (the decode pulling KV, an EPD prefill pulling embeddings)
BOOT_FAULTS = ("refuse", "cut", "delay")
#: faults on the stack while requests are in flight
CHAOS = ("cut_grpc", "flaky_reconnect", "kill_restart")


@dataclass
class SoakReport:
    """The soak's outcomes (in the order they ended), the chaos applied, and which outcomes belong to
    requests that started while no chaos action was under way (``calm``: between one action's recovery, the
    gateway seeing every worker healthy again, and the next action)."""

    outcomes: list[Outcome] = field(default_factory=list)
    chaos: list[str] = field(default_factory=list)
    calm: list[bool] = field(default_factory=list)

    def kinds(self, calm_only: bool = False) -> Counter[str]:
        return Counter(o.kind for o, c in zip(self.outcomes, self.calm) if c or not calm_only)


def soak(stack: FaultStack, requests: int, seed: int, concurrency: int = 6) -> SoakReport:
    """``requests`` requests, ``concurrency`` in flight, faults drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    bodies = stack.bodies()
    boot_links = [p for leg in stack.legs.values() if leg.boot is not None for p in (leg.boot,)]
    plan = []
    for _ in range(requests):
        variant = rng.randrange(len(bodies))
        bad = rng.random() < 0.06
        stream = rng.random() < 0.25
        boot = None
        if rng.random() < 0.2:
            kind = rng.choice(BOOT_FAULTS)
            fault = Fault(kind, after=rng.randrange(0, 4096), seconds=rng.uniform(0.05, 0.5))
            boot = (rng.choice(boot_links), fault)
        plan.append((variant, bad, stream, boot))
    # chaos: one action every ~40 requests, on a random leg, once that many requests have started
    chaos_at = sorted(rng.sample(range(10, requests - 10), k=max(2, requests // 40)))
    actions = [a for _ in range(len(chaos_at)) for a in rng.sample(CHAOS, len(CHAOS))]  # every kind, in turn
    chaos = [(at, actions[k], rng.choice(list(stack.legs)), rng.uniform(0.1, 0.8)) for k, at in enumerate(chaos_at)]

    report = SoakReport()
    outage = threading.Event()  # set from a chaos action until the gateway sees every worker healthy again
    started = threading.Semaphore(0)
    slots = threading.Semaphore(concurrency)
    lock = threading.Lock()

    def one(i: int) -> None:
        variant, bad, stream, boot = plan[i]
        try:
            body = dict(bodies[variant])
            if bad:
                body["logit_bias"] = BAD_LOGIT_BIAS
            if boot is not None:
                boot[0].arm(boot[1])
            calm = not outage.is_set()
            started.release()
            outcome = send(stack, body, None if bad else stack.expected[variant], stream)
            with lock:
                report.outcomes.append(outcome)
                report.calm.append(calm)
            if outcome.kind == "retryable":
                time.sleep(RETRY_PAUSE_S)  # a client backs off after a 503 (Retry-After), if not for its full second
        finally:
            slots.release()

    def chaos_thread() -> None:
        count = 0
        for at, action, role, pause in chaos:
            while count < at:
                started.acquire()
                count += 1
            leg = stack.legs[role]
            report.chaos.append(f"{action}:{role.value}@{at}")
            outage.set()
            if action == "cut_grpc":
                leg.grpc.cut_all()
            elif action == "flaky_reconnect":  # the link drops, and the next connection breaks off too
                leg.grpc.arm(Fault("cut", after=rng.randrange(0, 20000)))
                leg.grpc.cut_all()
            else:
                leg.kill()
                time.sleep(pause)
                leg.restart()
            time.sleep(HEALTH_INTERVAL_S + 0.1)  # the gateway's probe has seen the action ...
            stack.wait_healthy(timeout_s=60.0)  # ... and now sees every worker healthy again
            outage.clear()

    chaos_runner = threading.Thread(target=chaos_thread, name="soak-chaos", daemon=True)
    chaos_runner.start()
    with ThreadPoolExecutor(concurrency, thread_name_prefix="soak-client") as pool:
        futures = []
        for i in range(requests):
            slots.acquire()
            futures.append(pool.submit(one, i))
        for f in futures:
            f.result()
    for _ in range(requests):  # let the chaos thread finish whatever it was waiting for
        started.release()
    chaos_runner.join(timeout=60)
    assert not chaos_runner.is_alive()
    return report


def _check_soak(stack: FaultStack, requests: int, seed: int) -> None:
    for i, body in enumerate(stack.bodies()):  # warm-up, then the gateway's size
        assert _answer(stack.post(body)) == stack.expected[i]
    rss_warm = _rss_kib(stack.pid)
    report = soak(stack, requests, seed)
    wrong = [o for o in report.outcomes if o.kind == "wrong"]
    slow = [o for o in report.outcomes if o.seconds > BOUND_S]
    kinds = report.kinds()
    summary = (f"{dict(kinds)} calm={dict(report.kinds(calm_only=True))} chaos={report.chaos} "
               f"codes={Counter(o.code for o in report.outcomes)}")
    print(f"soak of {requests}: {summary}")
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {wrong[:5]}; {summary}"
    assert not slow, f"{len(slow)} requests over {BOUND_S}s: {slow[:5]}"
    assert len(report.outcomes) == requests
    # the faults did not take the stack down for good: between outages it serves.  Requests started during an
    # outage (a killed engine restarting, a cut link reconnecting) fail fast with a retryable 503, and how many
    # there are depends on how long a restart takes on this machine: they are not counted here.
    calm = report.kinds(calm_only=True)
    assert kinds["ok"] > 0 and calm["ok"] >= calm.total() // 3, f"calm {dict(calm)}; {summary}"
    assert kinds["retryable"] > 0, summary  # ... and they did bite
    assert kinds["rejected"] > 0, summary  # the engine's own 400 got through
    applied = Counter[str]()
    for leg in stack.legs.values():
        for proxy in leg.proxies():
            applied.update(proxy.applied)
    assert applied["refuse"] and applied["cut"] and applied["delay"], applied
    assert {c.partition(":")[0] for c in report.chaos} == set(CHAOS), report.chaos
    assert_clean(stack)
    if stack.shm:
        text = stack.client.get(f"{stack.url}/metrics").text
        assert _metric(text, "smg_mm_tensors_total", 'path="shm"') > 0, "the soak sent nothing through shm"
    rss_end = _rss_kib(stack.pid)
    assert rss_end < rss_warm * 1.5 + 96 * 1024, (rss_warm, rss_end)


@pytest.mark.parametrize("name", list(STACKS))
def test_a_fault_soak_leaves_every_request_answered_and_nothing_behind(
        stacks: dict[str, FaultStack], tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    _check_soak(_stack(stacks, name, tmp_path_factory), requests=120, seed=12)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STACKS))
def test_a_long_fault_soak(stacks: dict[str, FaultStack], tmp_path_factory: pytest.TempPathFactory,
                           name: str) -> None:
    _check_soak(_stack(stacks, name, tmp_path_factory), requests=600, seed=1212)


# ---- targeted: an engine killed at a known point of a request ------------------------------------------

def _in_thread(fn: Callable[[], Outcome]) -> tuple[threading.Thread, list[Outcome]]:
    box: list[Outcome] = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()
    return thread, box


def _big_body(stack: FaultStack) -> dict[str, Any]:
    """A request whose image keeps the vision tower busy for a while (the window a kill lands in)."""
    image = {"type": "image_url", "image_url": {"url": _png(448, 448, 7)}}
    return {**stack.bodies()[0], "messages": [{"role": "user", "content": [image, {"type": "text", "text": "Big?"}]}]}


KILLS = [  # (stack, the engine killed, where the request is when it dies)
    ("pd-tokenspeed-shm", Role.PREFILL, "model"),  # prefill killed while it runs the prompt
    ("pd-tokenspeed-shm", Role.PREFILL, "handoff"),  # prefill killed while the decode pulls its KV
    ("pd-sglang", Role.PREFILL, "model"),
    ("pd-sglang", Role.PREFILL, "handoff"),
    ("pd-tokenspeed-shm", Role.DECODE, "handoff"),  # decode killed while pulling the KV
    ("pd-sglang", Role.DECODE, "waiting"),  # decode killed while it waits for the prefill's room
    ("epd-tokenspeed-shm", Role.ENCODE, "model"),  # encode worker killed while its tower runs (Encode RPC)
    ("epd-tokenspeed-shm", Role.ENCODE, "handoff"),  # ... while the prefill pulls its embeddings
    ("epd-tokenspeed-shm", Role.PREFILL, "waiting"),  # EPD prefill killed while it waits for the embeddings
]


@pytest.mark.parametrize(("name", "role", "moment"), KILLS, ids=[f"{n}-{r.value}-{m}" for n, r, m in KILLS])
def test_an_engine_killed_mid_request_is_a_retryable_503(stacks: dict[str, FaultStack],
                                                         tmp_path_factory: pytest.TempPathFactory,
                                                         name: str, role: Role, moment: str) -> None:
    """The engine dies with the request inside it: ``model`` (its model thread runs the request), ``waiting``
    (it holds the request, waiting for a handoff), ``handoff`` (a delayed bootstrap connection of this
    request is open to or from it).  The answer is a retryable 503 within the bound; nothing is left behind."""
    stack = _stack(stacks, name, tmp_path_factory)
    recover(stack)
    victim = stack.legs[role]
    engine = victim.engine
    assert engine is not None
    body = _big_body(stack)
    if moment == "handoff":
        source = Role.PREFILL if role is Role.DECODE else role  # whose bootstrap port the pull goes to
        proxy = stack.legs[source].boot
        assert proxy is not None
        proxy.arm(Fault("delay", seconds=2.0))
        delays = proxy.applied["delay"]
        reached: Callable[[], bool] = lambda: proxy.applied["delay"] > delays
    elif moment == "waiting":  # the upstream's pull is held so that this engine waits
        upstream = stack.legs[Role.ENCODE if stack.epd and role is Role.PREFILL else Role.PREFILL]
        assert upstream.boot is not None
        upstream.boot.arm(Fault("delay", seconds=2.0))
        reached = lambda: engine.core.counts()[0] > 0
    else:
        reached = lambda: engine.core.counts()[1] > 0
    thread, box = _in_thread(lambda: send(stack, body, None, stream=False))
    assert _poll(reached, 10.0, every_s=0.005), "the request never got there"
    victim.kill()
    thread.join(BOUND_S)
    assert not thread.is_alive(), "hung request"
    (outcome,) = box
    assert outcome.kind == "retryable", outcome
    victim.restart()
    assert_clean(stack)


def test_the_decode_leg_lost_mid_stream_ends_the_stream_with_a_retryable_error(
        stacks: dict[str, FaultStack], tmp_path_factory: pytest.TempPathFactory) -> None:
    stack = _stack(stacks, "pd-tokenspeed-shm", tmp_path_factory)
    recover(stack)
    body = {**stack.bodies()[0], "max_tokens": 200, "stream": True}
    started = time.monotonic()
    with stack.client.stream("POST", f"{stack.url}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if '"logprobs":{' in line:  # a token arrived: the decode leg is streaming
                break
        stack.legs[Role.DECODE].grpc.cut_all()
        rest = [x for x in lines if x]
    assert time.monotonic() - started < BOUND_S
    assert rest[-1] == "data: [DONE]"
    events = [json.loads(x[len("data: "):]) for x in rest if x.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert [e["code"] for e in errors] == [ErrorCode.ENGINE_UNAVAILABLE.value], events[-3:]
    assert_clean(stack)


@pytest.mark.parametrize("name", list(STACKS))
def test_a_request_the_prefill_refuses_is_the_engines_own_400(stacks: dict[str, FaultStack],
                                                               tmp_path_factory: pytest.TempPathFactory,
                                                               name: str) -> None:
    """A ``logit_bias`` id outside the model's vocabulary passes the gateway's checks and is refused by the
    engines (the prefill fails its room for the decode): 400 ``engine_rejected``, nothing left behind (the
    failed room expires with the handoff timeout)."""
    stack = _stack(stacks, name, tmp_path_factory)
    recover(stack)
    outcome = send(stack, {**stack.bodies()[2], "logit_bias": BAD_LOGIT_BIAS}, None, stream=False)
    assert outcome.kind == "rejected", outcome
    assert outcome.seconds < HANDOFF_WAIT_S
    assert_clean(stack)


def _in_flight(client: httpx.Client, url: str) -> list[int]:
    return [w["in_flight"] for w in client.get(f"{url}/workers").json()["workers"]]


@pytest.mark.parametrize("stream", [False, True], ids=["before-the-request", "mid-stream"])
def test_a_decode_link_gone_silent_is_not_a_hung_request(stacks: dict[str, FaultStack],
                                                         tmp_path_factory: pytest.TempPathFactory, stream: bool) -> None:
    """The decode engine's link stops carrying bytes but stays open (a frozen process, a partition), before the
    request is sent or once its stream is under way: the gateway's keepalive pings go unanswered, the connection
    is closed and the decode leg fails, so the request ends within :data:`SILENT_BOUND_S` as when the link closes
    -- a retryable 503 ``engine_unavailable``, or that error event ending the started stream -- with its shared
    memory segments and its count in flight released while the link is still frozen."""
    stack = _stack(stacks, "pd-tokenspeed-shm", tmp_path_factory)
    recover(stack)
    decode = stack.legs[Role.DECODE].grpc
    try:
        started = time.monotonic()
        if stream:
            body = {**stack.bodies()[0], "max_tokens": 200, "stream": True}
            with stack.client.stream("POST", f"{stack.url}/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                for line in lines:
                    if '"logprobs":{' in line:  # a token arrived: the decode leg is streaming
                        break
                decode.freeze()
                rest = [x for x in lines if x]
            seconds = time.monotonic() - started
            assert rest[-1] == "data: [DONE]"
            events = [json.loads(x[len("data: "):]) for x in rest if x.startswith("data: {")]
            assert [e["error"]["code"] for e in events if "error" in e] == [ErrorCode.ENGINE_UNAVAILABLE.value], \
                events[-3:]
        else:
            decode.freeze()
            outcome = send(stack, stack.bodies()[0], stack.expected[0], stream=False)
            assert (outcome.kind, outcome.code) == ("retryable", ErrorCode.ENGINE_UNAVAILABLE.value), outcome
            seconds = outcome.seconds
        assert seconds < SILENT_BOUND_S, f"{seconds:.1f}s"
        assert _poll(lambda: not _segments(stack.pid), 5.0), sorted(_segments(stack.pid))
        assert _poll(lambda: not any(_in_flight(stack.client, stack.url)), 5.0)
    finally:
        decode.thaw()
        decode.cut_all()
    assert_clean(stack)


def test_a_single_workers_link_gone_silent_is_not_a_hung_request(tmp_path: Path) -> None:
    """Without disaggregation: two TokenSpeed workers behind proxies, shared-memory tensors, the second worker's
    link frozen.  A request on it ends with a retryable 503 ``engine_unavailable`` within
    :data:`SILENT_BOUND_S`, leaving no shared-memory segment; a request sent while it waits goes to the other
    worker (``--policy round_robin``) and is answered right; once the link thaws both workers serve again."""
    image = {"type": "image_url", "image_url": {"url": _png(40, 60, 5)}}
    body = {"model": QWEN3, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": True,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]}
    legs: list[Proxied] = []
    gateway: Child | None = None
    client = httpx.Client(timeout=CLIENT_TIMEOUT_S)
    try:
        for _ in range(2):  # the same seeded weights: either worker gives the same answer
            legs.append(Proxied.start(EngineConfig(model=bundle_dir(QWEN3), port=0, wire=Wire.TOKENSPEED)))
        # round_robin: the first request goes to the first worker, the one on the frozen link to the second, the
        # one sent meanwhile to the first again (the default cache_aware policy would send the same prompt back to
        # the worker that holds its prefix: the frozen one).
        extra = ["--served-model-name", QWEN3, "--worker-health-interval", str(HEALTH_INTERVAL_S),
                 "--multimodal-tensor-transport", "shm", "--multimodal-shm-min-bytes", "0", "--policy", "round_robin",
                 *KEEPALIVE_ARGS]
        gateway = start_gateway(str(bundle_dir(QWEN3)), [leg.grpc.port for leg in legs], extra=extra, log_dir=tmp_path)
        url = f"http://127.0.0.1:{gateway.port}"
        chat = f"{url}/v1/chat/completions"
        pid = gateway.proc.pid
        expected = _answer(client.post(chat, json=body))
        frozen = legs[1].grpc
        frozen.freeze()
        try:
            thread, box = _in_thread(lambda: _timed_post(client, chat, body))
            assert _poll(lambda: _in_flight(client, url)[1] == 1, 10.0), _in_flight(client, url)
            assert _answer(client.post(chat, json=body)) == expected  # the other worker serves meanwhile
            thread.join(SILENT_BOUND_S + 5.0)
            assert not thread.is_alive(), "hung request"
            (outcome,) = box
            assert (outcome.kind, outcome.code) == ("retryable", ErrorCode.ENGINE_UNAVAILABLE.value), outcome
            assert outcome.seconds < SILENT_BOUND_S, outcome
            assert _poll(lambda: not _segments(pid), 5.0), sorted(_segments(pid))
            assert _poll(lambda: not any(_in_flight(client, url)), 5.0), _in_flight(client, url)
        finally:
            frozen.thaw()
            frozen.cut_all()
        wait_http_health(gateway, timeout_s=30.0, want_workers=2)
        assert _answer(client.post(chat, json=body)) == expected
        assert _poll(lambda: all(leg.engine is not None and leg.engine.core.counts() == (0, 0) for leg in legs), 10.0)
    finally:
        client.close()
        if gateway is not None:
            gateway.stop()
        for leg in legs:
            leg.stop()


def _timed_post(client: httpx.Client, url: str, body: dict[str, Any]) -> Outcome:
    started = time.monotonic()
    resp = client.post(url, json=body)
    return _classify(resp, None, time.monotonic() - started)

"""The corpus stack (session scope) and the per-group pass count printed at the end of the run.

Stack: for each profile the cases name (and ``qwen2_vl``, which the SSRF,
soak and intake tests use) a temporary bundle with the profile's processor
values, a reference engine process, a recording gRPC proxy in front of it and
a gateway process (``--mm-allow-private-media-hosts``, short fetch timeouts)
whose worker is that proxy; one scripted loopback media origin; and, for the
SSRF cases, the real gateway app in a thread under the *default* policy with
its fetcher's resolver and socket layer replaced: test names resolve from a
table, the routed "public" test address goes to the loopback origin, loopback
literals are dialled for real (a policy failure would reach the origin, whose
hits must stay at zero) and anything else is recorded and refused.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mmgate.cli.launch import Child, start_engine, start_gateway
from tests.conftest import model_roots
from tests.corpus.cases import BASE_PROFILE, group_of, load_corpus, profiles_in_use
from tests.corpus.stack import (
    ALLOWED_TEST_HOST,
    RecordingProxy,
    known_flags,
    profile_bundle,
)
from tests.media.gateways import RoutedResolver, ssrf_gateway
from tests.media.hostile_urls import PUBLIC
from tests.media.netfakes import LoopbackOnlyBackend
from tests.media.origin import ScriptedOrigin, scripted_origin

FETCH_TOTAL_TIMEOUT_S = 3.0


@dataclass
class Profile:
    name: str
    bundle: Path
    served_name: str
    engine: Child
    proxy: RecordingProxy
    gateway: Child

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"


@dataclass
class CorpusStack:
    profiles: dict[str, Profile]
    origin: ScriptedOrigin
    ssrf_base: str
    ssrf_backend: LoopbackOnlyBackend
    ssrf_resolver: RoutedResolver
    log_dir: Path
    references: dict[str, Any] = field(default_factory=dict)

    def reference_processor(self, profile: str) -> Any:
        """The profile bundle's transformers 5.24 image processor, as ``AutoImageProcessor`` picks it (the
        torchvision class, the gateway's auto backend): ``Qwen2VLImageProcessor``, ``CLIPImageProcessor``."""
        if profile not in self.references:
            from transformers import AutoImageProcessor

            self.references[profile] = AutoImageProcessor.from_pretrained(self.profiles[profile].bundle)
        return self.references[profile]


def _start_profile(name: str, values: dict[str, Any], root: Path, logs: Path) -> Profile:
    bundle = profile_bundle(model_roots()[0], root, name, values)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # idle OpenMP threads must not spin on a 2-core machine
    engine = start_engine(str(bundle), extra=["--num-threads", "1"], log_dir=logs, env=env)
    proxy = RecordingProxy(engine.port)
    served = f"corpus/{name}"
    extra = ["--mm-allow-private-media-hosts", "--served-model-name", served, "--default-max-tokens", "2",
             "--mm-fetch-timeout", str(FETCH_TOTAL_TIMEOUT_S), "--mm-fetch-read-timeout", "2",
             "--mm-fetch-connect-timeout", "2",
             *known_flags("--mm-processing", "router", "--multimodal-tensor-transport", "inline",
                          "--multimodal-encoder-dtype", "float32")]
    try:
        gateway = start_gateway(str(bundle), [proxy.port], extra=extra, log_dir=logs, env=env)
    except BaseException:
        proxy.close()
        engine.stop()
        raise
    return Profile(name, bundle, served, engine, proxy, gateway)


@pytest.fixture(scope="session")
def corpus_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CorpusStack]:
    corpus = load_corpus()
    root = tmp_path_factory.mktemp("corpus-bundles")
    logs = tmp_path_factory.mktemp("corpus-logs")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {n: pool.submit(_start_profile, n, corpus.profiles[n], root, logs) for n in profiles_in_use(corpus)}
        profiles: dict[str, Profile] = {}
        errors = []
        for name, fut in futures.items():
            try:
                profiles[name] = fut.result()
            except BaseException as exc:  # noqa: BLE001 - stop the others, then re-raise
                errors.append(exc)
    try:
        if errors:
            raise errors[0]
        with scripted_origin() as origin:
            backend = LoopbackOnlyBackend({(PUBLIC, 80): origin.port}, pass_loopback=True)
            resolver = RoutedResolver({ALLOWED_TEST_HOST: [PUBLIC]})
            q2 = profiles[BASE_PROFILE]
            with ssrf_gateway(q2.bundle, q2.served_name, q2.proxy.port, backend, resolver) as ssrf_base:
                yield CorpusStack(profiles, origin, ssrf_base, backend, resolver, logs)
    finally:
        for p in profiles.values():
            p.gateway.stop()
            p.proxy.close()
            p.engine.stop()


# ---------------------------------------------------------------- per-group tally

_RESULTS: dict[str, Counter[str]] = defaultdict(Counter)
_PENDING: dict[str, list[str]] = defaultdict(list)


def record_pending(reason: str, case_id: str) -> None:
    _PENDING[reason].append(case_id)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "test_corpus.py::test_corpus_case[" not in report.nodeid:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        case_id = report.nodeid.split("[", 1)[1].rstrip("]")
        outcome = "pending" if hasattr(report, "wasxfail") else report.outcome
        _RESULTS[group_of(case_id)][outcome] += 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _RESULTS:
        return
    write = terminalreporter.write_line
    write("")
    write("edge-case corpus, per group (passed / judged; pending = xfail(strict) until supported):")
    for group in sorted(_RESULTS):
        c = _RESULTS[group]
        judged = c["passed"] + c["failed"]
        write(f"  {group}: {c['passed']}/{judged} passed" + (f", {c['pending']} pending" if c["pending"] else "")
              + (f", {c['skipped']} skipped" if c["skipped"] else ""))
    total = sum(c["passed"] for c in _RESULTS.values()), sum(c["passed"] + c["failed"] for c in _RESULTS.values())
    write(f"  total: {total[0]}/{total[1]} passed")
    for reason, ids in _PENDING.items():
        write(f"  pending: {reason} ({len(ids)}): {', '.join(ids)}")
    if not _PENDING:
        write("  pending: none (0)")

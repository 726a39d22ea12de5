"""The engine seam: detection without a flag, typed capabilities, neutral events, selection by adapter.

Workers are loopback fakes of each wire (tests/support/fake_worker.py for vLLM,
tests/support/fake_engines.py for SGLang and TokenSpeed); the expected values are what those fakes
answer, read the way smg-grpc-servicer's servicers fill the same fields.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent import futures
from typing import Any, TypeVar

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.engines import adapter as adapter_module
from mmgate.engines import vllm
from mmgate.engines.adapter import ADAPTERS, VllmAdapter, adapter_for
from mmgate.engines.base import (
    Capabilities,
    EngineEvent,
    Logprobs,
    Probe,
    ProbeOutcome,
    Role,
    TopLogprobs,
    Wire,
)
from mmgate.engines.capabilities import MediaKind, worker_modalities
from mmgate.engines.client import WorkerClient
from mmgate.engines.probe import SERVICES, healthy_sync
from mmgate.errors import ErrorCode, GatewayError
from mmgate.cli.launch import free_port
from mmgate.routing.workers import HealthPolicy, Worker, WorkerRegistry
from mmgate.config.settings import TensorTransport, TransportSettings
from mmgate.types import Modality
from tests.support.fake_engines import FakeEngine, FakeEngineState
from tests.support.fake_worker import FakeWorker, FakeWorkerState

T = TypeVar("T")
IMAGE_VIDEO = frozenset({Modality.IMAGE, Modality.VIDEO})


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def probe_once(url: str) -> tuple[Probe, Wire | None]:
    client = WorkerClient(url.removeprefix("grpc://"))
    try:
        probe = await client.probe(timeout_s=5.0)
        return probe, client.wire
    finally:
        await client.close()


# ---- detection and capabilities -----------------------------------------------------------------

def test_a_vllm_worker_is_detected_and_its_info_typed() -> None:
    worker = FakeWorker(FakeWorkerState(labels={"shm_namespace_id": "boot:42", "multimodal_encoder_dtype": "bfloat16",
                                                "mm_processor": "inprocess", "mm_media_ref_schemes": "http,data"}))
    try:
        probe, wire = run(probe_once(worker.url))
    finally:
        worker.stop()
    caps = probe.capabilities
    assert probe.outcome is ProbeOutcome.OK and wire is Wire.VLLM and caps is not None
    assert (caps.wire, caps.role, caps.modalities) == (Wire.VLLM, Role.SINGLE, IMAGE_VIDEO)
    assert (caps.shm_namespace, caps.encoder_dtype, caps.mm_processor) == ("boot:42", "bfloat16", "inprocess")
    assert caps.media_ref_schemes == {"http", "data"} and not caps.language_model_only
    assert caps.labels["shm_namespace_id"] == "boot:42" and caps.eos_token_ids == (151645,)


def test_an_sglang_worker_is_detected_and_takes_images_only() -> None:
    engine = FakeEngine("sglang", FakeEngineState(server_args={"disaggregation_mode": "decode"}))
    try:
        probe, wire = run(probe_once(engine.url))
    finally:
        engine.stop()
    caps = probe.capabilities
    assert probe.outcome is ProbeOutcome.OK and wire is Wire.SGLANG and caps is not None
    assert (caps.role, caps.modalities, caps.shm_namespace) == (Role.DECODE, frozenset({Modality.IMAGE}), "")
    assert engine.state.calls == {"HealthCheck": 1, "GetModelInfo": 1, "GetServerInfo": 1}


def test_sglang_encoder_only_and_language_only_workers() -> None:
    enc = FakeEngine("sglang", FakeEngineState(server_args={"encoder_only": True}))
    lang = FakeEngine("sglang", FakeEngineState(server_args={"language_only": True, "disaggregation_mode": "prefill"}))
    try:
        enc_caps = run(probe_once(enc.url))[0].capabilities
        lang_caps = run(probe_once(lang.url))[0].capabilities
    finally:
        enc.stop()
        lang.stop()
    assert enc_caps is not None and enc_caps.role is Role.ENCODE and not enc_caps.language_model_only
    assert lang_caps is not None and lang_caps.role is Role.PREFILL and lang_caps.language_model_only


def test_a_tokenspeed_worker_reports_its_modalities_dtype_and_shm_namespace() -> None:
    engine = FakeEngine("tokenspeed", FakeEngineState(supported_modalities=("image", "audio"), encoder_dtype="float16",
                                                      shm_namespace_id="boot:7",
                                                      server_args={"disaggregation_mode": "encode"}))
    try:
        probe, wire = run(probe_once(engine.url))
    finally:
        engine.stop()
    caps = probe.capabilities
    assert wire is Wire.TOKENSPEED and caps is not None
    assert caps.modalities == {Modality.IMAGE, Modality.AUDIO}
    assert (caps.role, caps.encoder_dtype, caps.shm_namespace) == (Role.ENCODE, "float16", "boot:7")
    assert (caps.labels["shm_namespace_id"], caps.labels["multimodal_encoder_dtype"]) == ("boot:7", "float16")


def test_a_worker_that_is_not_serving_is_detected_but_not_ok() -> None:
    engine = FakeEngine("tokenspeed", FakeEngineState(healthy=False))
    try:
        probe, wire = run(probe_once(engine.url))
    finally:
        engine.stop()
    assert (probe.outcome, probe.wire, wire) == (ProbeOutcome.NOT_SERVING, Wire.TOKENSPEED, Wire.TOKENSPEED)
    assert engine.state.calls == {"HealthCheck": 1}


def test_nothing_listening_is_unreachable() -> None:
    probe, wire = run(probe_once(f"127.0.0.1:{free_port()}"))
    assert (probe.outcome, wire) == (ProbeOutcome.UNREACHABLE, None)


def test_a_server_of_no_engine_service_is_an_error() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        probe, wire = run(probe_once(f"127.0.0.1:{port}"))
    finally:
        server.stop(grace=0)
    assert (probe.outcome, wire) == (ProbeOutcome.ERROR, None)


def test_another_engine_at_the_same_address_is_detected_again() -> None:
    async def scenario() -> list[Wire | None]:
        first = FakeEngine("sglang")
        client = WorkerClient(f"127.0.0.1:{first.port}")
        seen = [(await client.probe(5.0)).wire]
        first.stop()
        second = FakeEngine("tokenspeed", port=first.port)
        try:
            for _ in range(50):  # the channel reconnects within its backoff
                probe = await client.probe(5.0)
                if probe.outcome is ProbeOutcome.OK:
                    break
                await asyncio.sleep(0.1)
            seen.append(probe.wire)
        finally:
            second.stop()
            await client.close()
        return seen

    assert run(scenario()) == [Wire.SGLANG, Wire.TOKENSPEED]


def test_launch_waits_on_any_wire() -> None:
    engine = FakeEngine("sglang")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{engine.port}") as channel:
            assert healthy_sync(channel)
        engine.state.healthy = False
        with grpc.insecure_channel(f"127.0.0.1:{engine.port}") as channel:
            assert not healthy_sync(channel)
    finally:
        engine.stop()


# ---- the matrix and selection ---------------------------------------------------------------------

def caps(wire: Wire, modalities: frozenset[Modality] = IMAGE_VIDEO) -> Capabilities:
    return Capabilities(wire=wire, role=Role.SINGLE, supports_vision=bool(modalities),
                        modalities=worker_modalities(wire, modalities))


def registry(*wires: Wire) -> WorkerRegistry:
    reg = WorkerRegistry([f"grpc://127.0.0.1:{9000 + i}" for i in range(len(wires))], HealthPolicy())
    for worker, wire in zip(reg.workers, wires, strict=True):
        worker.record_probe(Probe(ProbeOutcome.OK, caps(wire), wire=wire), reg.policy, now=1.0, last_answer=1.0)
        worker.client = object()  # type: ignore[assignment]  # selection only checks that one exists
    return reg


def refused(reg: WorkerRegistry, kind: MediaKind) -> str | None:
    try:
        reg.check_kinds({kind: "messages[0].content[0]"})
    except GatewayError as exc:
        assert exc.code is ErrorCode.MULTIMODAL_NOT_SUPPORTED and exc.param == "messages[0].content[0]"
        return exc.message
    return None


def test_a_worker_takes_its_wires_row_narrowed_to_its_model() -> None:
    assert caps(Wire.SGLANG).modalities == {Modality.IMAGE}
    assert caps(Wire.VLLM, frozenset({Modality.IMAGE, Modality.AUDIO})).modalities == {Modality.IMAGE}
    assert caps(Wire.TOKENSPEED, frozenset(Modality)).modalities == frozenset(Modality)
    assert caps(Wire.TOKENSPEED, frozenset()).modalities == frozenset()


def test_a_kind_is_refused_only_when_no_registered_worker_takes_it() -> None:
    assert refused(registry(Wire.SGLANG), MediaKind.VIDEO) is not None
    assert refused(registry(Wire.SGLANG, Wire.VLLM), MediaKind.VIDEO) is None
    assert refused(registry(Wire.VLLM), MediaKind.AUDIO) is not None
    assert refused(registry(Wire.SGLANG, Wire.VLLM), MediaKind.AUDIO) is not None
    assert refused(registry(Wire.TOKENSPEED), MediaKind.AUDIO) is not None  # its model (image, video) does not


def test_embeddings_are_refused_even_before_any_worker_is_known() -> None:
    unknown = WorkerRegistry(["grpc://127.0.0.1:9"], HealthPolicy())
    assert refused(unknown, MediaKind.VIDEO) is None  # nothing known: selection decides later
    assert refused(unknown, MediaKind.IMAGE_EMBEDS) is not None


def test_capabilities_survive_a_failed_probe() -> None:
    reg = registry(Wire.SGLANG)
    worker = reg.workers[0]
    worker.record_probe(Probe(ProbeOutcome.UNREACHABLE), reg.policy, now=2.0, last_answer=1.0)
    assert not worker.healthy and worker.labels["wire"] == "sglang"
    assert refused(reg, MediaKind.VIDEO) is not None


def test_every_wire_has_an_adapter_and_an_unknown_one_none() -> None:
    assert set(ADAPTERS) == set(Wire)
    assert adapter_for("nope") is None and adapter_for("") is None and adapter_for(None) is None
    assert {w: adapter_for(w.value).service for w in Wire} == {w: SERVICES[w].service for w in Wire}  # type: ignore[union-attr]


def test_selection_skips_workers_of_a_wire_without_an_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter_module, "ADAPTERS", {Wire.VLLM: VllmAdapter()})
    mixed = registry(Wire.VLLM, Wire.SGLANG, Wire.TOKENSPEED)
    mixed.workers[0].in_flight = 5  # the most loaded, and still the only one chosen
    assert mixed.select({Modality.IMAGE}).wire == "vllm"
    with pytest.raises(GatewayError) as info:
        registry(Wire.SGLANG, Wire.TOKENSPEED).select({Modality.IMAGE})
    assert info.value.code is ErrorCode.NO_HEALTHY_WORKER and "sglang, tokenspeed" in info.value.message


def test_a_worker_shows_its_assigned_role_over_the_reported_one() -> None:
    worker = Worker(url="grpc://h:1", target="h:1", assigned_role=Role.DECODE)
    worker.record_probe(Probe(ProbeOutcome.OK, caps(Wire.VLLM), wire=Wire.VLLM), HealthPolicy(), 1.0, 1.0)
    assert (worker.labels["wire"], worker.labels["role"]) == ("vllm", "decode")


# ---- the vLLM adapter --------------------------------------------------------------------------

def test_vllm_responses_become_neutral_events() -> None:
    top = vllm_engine_pb2.TopLogProbs(values=[-0.1, -2.0], token_ids=[5, 6])
    lp = vllm_engine_pb2.OutputLogProbs(token_logprobs=[-0.1], token_ids=[5], top_logprobs=[top])
    chunk = vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
        token_ids=[5], prompt_tokens=10, completion_tokens=1, cached_tokens=4, output_logprobs=lp, index=1))
    (event,) = vllm.events(chunk)
    assert event == EngineEvent(kind="chunk", index=1, token_ids=(5,), prompt_tokens=10, completion_tokens=1,
                                cached_tokens=4, logprobs=Logprobs((5,), (pytest.approx(-0.1),),
                                                                   (TopLogprobs((5, 6), (pytest.approx(-0.1), -2.0)),)))
    by_token = vllm_engine_pb2.GenerateComplete(output_ids=[5, 7], finish_reason="stop", matched_token_id=7)
    by_string = vllm_engine_pb2.GenerateComplete(finish_reason="stop", matched_stop_str="")
    eos = vllm_engine_pb2.GenerateComplete(finish_reason="stop", kv_transfer_params_json='{"a":1}')
    got = [vllm.events(vllm_engine_pb2.GenerateResponse(complete=c))[0] for c in (by_token, by_string, eos)]
    assert [(e.kind, e.matched_token_id, e.matched_stop_str) for e in got] == [
        ("complete", 7, None), ("complete", None, ""), ("complete", None, None)]
    assert got[0].token_ids == (5, 7) and got[2].kv_transfer_params == '{"a":1}' and got[0].kv_transfer_params is None
    assert vllm.events(vllm_engine_pb2.GenerateResponse()) == []


def test_the_vllm_adapter_encodes_single_prefill_and_decode_legs() -> None:
    adapter = VllmAdapter()
    assert adapter.service == SERVICES[Wire.VLLM].service == "vllm.grpc.engine.VllmEngine"
    assert adapter.rpc(Role.SINGLE)[0] == "/vllm.grpc.engine.VllmEngine/Generate"
    assert adapter.roles == {Role.SINGLE, Role.PREFILL, Role.DECODE} and adapter.sequential_pd
    with pytest.raises(ValueError, match="not encode"):
        adapter.check_role(Role.ENCODE)


def test_a_wire_without_shm_handles_never_plans_shared_memory() -> None:
    class NoShm(VllmAdapter):
        shm = False

    transport = TransportSettings(tensor_transport=TensorTransport.SHM)
    assert VllmAdapter().plan(transport, {}).shm
    assert not NoShm().plan(transport, {}).shm


# ---- the seam's boundary ---------------------------------------------------------------------------

SEAM = {"mmgate.engines.base", "mmgate.engines.adapter", "mmgate.engines.client", "mmgate.engines.capabilities"}


def test_api_and_routing_import_only_the_seam() -> None:
    """No proto type and no wire module outside ``engines/``: ``api/`` and ``routing/`` import the seam only."""
    import ast
    from pathlib import Path

    import mmgate

    root = Path(mmgate.__file__).parent
    offending = []
    for path in sorted([*root.glob("api/*.py"), *root.glob("routing/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("smg_grpc_proto") or (name.startswith("mmgate.engines") and name not in SEAM):
                    offending.append(f"{path.relative_to(root)}: {name}")
    assert offending == []

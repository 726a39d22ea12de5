"""The engine seam: one adapter per wire behind one interface, and the registry of adapters.

Stage: assemble -> transport -> engine.  In: a :class:`~mmgate.types.PreparedRequest` (planned and
expanded once, engine-neutral), the :class:`~mmgate.engines.base.Role` of the leg, the worker's
:class:`~mmgate.transport.policy.WirePlan` and shared-memory lease, and for a disaggregated leg its
:class:`~mmgate.engines.base.Bootstrap` (SGLang, TokenSpeed) or ``kv_transfer_params`` (vLLM); out:
the wire's message, serialized (:class:`~mmgate.engines.base.EncodedRequest`); back: the wire's
responses as :class:`~mmgate.engines.base.EngineEvent` values, its RPC failures as
:class:`~mmgate.errors.GatewayError` (:mod:`mmgate.engines.rpc_errors`).

The seam ``api/`` and ``routing/`` see: :mod:`mmgate.engines.base` (types), this module (adapters),
:mod:`mmgate.engines.client` (the one client: detection, health, info, calls) and
:mod:`mmgate.engines.capabilities` (the engine x modality matrix).  Engine field names and proto
types stay in ``engines/``.

A wire plugs in with a small adapter class and one line in :data:`ADAPTERS`.  Its module
(``engines/<wire>.py``) provides the encoder and the response reader; the adapter names them,
with the wire's ``GenerateResponse`` type, whether its tensors can name a shared-memory segment,
and the roles it encodes (:class:`SglangAdapter` is the whole of it for SGLang).

A worker whose wire has no adapter here is still detected, shown by ``GET /workers`` and counted
by the capability check, but never selected (:mod:`mmgate.routing.workers`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Protocol

import grpc
from smg_grpc_proto.generated import (
    sglang_scheduler_pb2,
    tokenspeed_encoder_pb2,
    tokenspeed_scheduler_pb2,
    vllm_engine_pb2,
)

from mmgate.observe import metrics
from mmgate.engines import sglang, tokenspeed, vllm
from mmgate.engines.base import Bootstrap, EncodedRequest, EngineEvent, Role, Wire
from mmgate.engines.probe import SERVICES
from mmgate.engines.rpc_errors import map_rpc_error
from mmgate.errors import ErrorCode, GatewayError
from mmgate.config.settings import TransportSettings
from mmgate.transport.dtypes import EncoderDtype
from mmgate.transport.policy import WirePlan, wire_plan
from mmgate.transport.shm import ShmError, ShmLease
from mmgate.types import MediaRef, Modality, PreparedRequest


class EncodeDisaggregation(Protocol):
    """A wire's encode disaggregation (EPD): each media item encoded by an encode worker in its own RPC, the
    prefill leg naming where each item's embeddings wait.  Reached through :meth:`WireAdapter.epd`, so
    routing never names the wire that offers it."""

    def encode_rpc(self) -> tuple[str, Callable[[bytes], Any]]:
        """(method path, response parser) of the ``Encode`` call of an encode worker."""
        ...

    def item_hashes(self, prepared: PreparedRequest) -> list[str]:
        """Each item's content hash, in prompt order (what ``--encode-policy consistent_hashing`` keys on)."""
        ...

    def encode_item(self, prepared: PreparedRequest, index: int, bootstrap: Bootstrap, plan: WirePlan,
                    lease: ShmLease | None) -> EncodedRequest:
        """The encode request of item ``index`` (materialized tensors) for its encode worker."""
        ...

    def encode_epd_prefill(self, prepared: PreparedRequest, plan: WirePlan, lease: ShmLease | None,
                           bootstrap: Bootstrap, encode_bootstrap: Sequence[Bootstrap]) -> EncodedRequest:
        """The prefill leg of an EPD request: items without encoder input, each item's encoder bootstrap."""
        ...


class WireAdapter(ABC):
    """One wire's codec: a prepared request in for a role, the wire's answer out as engine events.

    Subclasses set :attr:`wire` and :attr:`response_type` and implement :meth:`events` and either
    :meth:`build` (a message; :meth:`encode` serializes it) or :meth:`encode` itself (a wire that
    writes pending pixels straight into its buffer, as vLLM's does).
    """

    wire: ClassVar[Wire]
    #: the wire's ``GenerateResponse`` message class (what the ``Generate`` stream carries)
    response_type: ClassVar[Any]
    #: whether the wire's ``TensorData`` can name a shared-memory segment
    shm: ClassVar[bool] = True
    #: the roles :meth:`encode` can build a message for
    roles: ClassVar[frozenset[Role]] = frozenset({Role.SINGLE})
    #: whether the wire carries media references for worker-side processing (``--mm-processing worker``)
    media_refs: ClassVar[bool] = False
    #: whether :meth:`encode` places a pending tensor straight into its buffer (else :meth:`materialize` first)
    places_pending: ClassVar[bool] = True
    #: how the two legs of a prefill/decode pair meet: False = one minted :class:`Bootstrap` on both legs,
    #: sent together (SGLang, TokenSpeed); True = the prefill leg is answered first and its Complete's
    #: ``EngineEvent.kv_transfer_params`` go to the decode leg (vLLM)
    sequential_pd: ClassVar[bool] = False
    #: whether the wire's single-consumer KV handoff can serve ``n > 1`` choices from one prefill (False on
    #: vLLM: SMG relays no handoff for ``n > 1``; the decode worker computes the prompt itself)
    pd_n_samples: ClassVar[bool] = True

    @property
    def service(self) -> str:
        """The wire's full gRPC service name."""
        return SERVICES[self.wire].service

    def rpc(self, role: Role) -> tuple[str, Callable[[bytes], Any]]:
        """(method path, response parser) of the call that runs a leg of ``role`` (``Generate``)."""
        return f"/{self.service}/Generate", self.response_type.FromString

    def plan(self, transport: TransportSettings, labels: Mapping[str, str]) -> WirePlan:
        """How tensors travel to a worker with ``labels`` (:func:`mmgate.transport.policy.wire_plan`);
        never through shared memory on a wire whose tensors cannot name a segment."""
        planned = wire_plan(transport, labels)
        return planned if self.shm else replace(planned, shm=False)

    async def materialize(self, prepared: PreparedRequest) -> PreparedRequest:
        """``prepared`` as :meth:`encode` takes it: a wire that cannot place a pending tensor
        (:class:`~mmgate.types.PendingTensor`) straight into its buffer (``places_pending = False``)
        computes it here first."""
        return prepared

    def check_role(self, role: Role) -> None:
        """Raises ValueError for a role this adapter cannot encode (a routing bug, never the caller's)."""
        if role not in self.roles:
            raise ValueError(f"the {self.wire.value} adapter encodes {sorted(r.value for r in self.roles)} legs, "
                             f"not {role.value}")

    def build(self, prepared: PreparedRequest, role: Role, plan: WirePlan, lease: ShmLease | None,
              bootstrap: Bootstrap | None = None, kv_transfer_params: str | None = None) -> Any:
        """The wire's request message for one leg (arrays only: no pending tensor)."""
        raise NotImplementedError(f"{type(self).__name__} encodes through encode()")

    async def fill(self, encoded: EncodedRequest, prepared: PreparedRequest, role: Role, plan: WirePlan,
                   lease: ShmLease) -> EncodedRequest:
        """``encoded`` (:meth:`encode` of ``prepared`` for ``role`` under ``plan``) with its pending tensors
        computed; when ``/dev/shm`` fills up while they are written (:class:`~mmgate.transport.shm.ShmError`),
        the failure is counted (``smg_mm_shm_write_failures_total``), ``lease``'s segments are released and the
        leg is encoded and filled again inline."""
        try:
            await encoded.fill()
            return encoded
        except ShmError:
            metrics.SHM_WRITE_FAILURES.labels(self.wire.value).inc()
            lease.release()
            encoded = self.encode(prepared, role, replace(plan, shm=False), None)
            await encoded.fill()
            return encoded

    def encode(self, prepared: PreparedRequest, role: Role, plan: WirePlan, lease: ShmLease | None,
               bootstrap: Bootstrap | None = None, kv_transfer_params: str | None = None,
               language_model_only: bool = False) -> EncodedRequest:
        """The serialized request of one leg of ``prepared`` for a worker of this wire.

        ``lease`` records the shared-memory segments created for it (the caller releases it when the
        engine has answered); ``bootstrap`` pairs the legs of a disaggregated request on SGLang and
        TokenSpeed, ``kv_transfer_params`` (JSON) does on vLLM: on a prefill leg the params it is
        tagged with (None: the wire's default), on a decode leg those its prefill answered (None: none
        relayed).  ``language_model_only``: the decode worker runs the language model only (vLLM: the
        decode leg carries the media's hashes and placeholders without the grids; the other wires'
        decode legs carry no encoder input either way).

        Raises:
            GatewayError: a value the wire cannot carry (e.g. ``invalid_request`` for a sampling field).
        """
        self.check_role(role)
        return EncodedRequest(self.build(prepared, role, plan, lease, bootstrap, kv_transfer_params).SerializeToString())

    def encode_media_refs(self, prepared: PreparedRequest, refs: Sequence[MediaRef]) -> EncodedRequest:
        """The request of worker-side media processing: the unexpanded prompt and the media URLs.

        Raises:
            GatewayError(MULTIMODAL_NOT_SUPPORTED): the wire carries no media references.
        """
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                           f"the {self.wire.value} wire carries no media references", refs[0].param if refs else None)

    @abstractmethod
    def events(self, response: Any) -> list[EngineEvent]:
        """One response message of the wire's stream as engine events."""

    def map_error(self, exc: grpc.RpcError) -> GatewayError:
        """A failed call of this wire -> the error table (:func:`mmgate.engines.rpc_errors.map_rpc_error`)."""
        return map_rpc_error(exc)

    def epd(self) -> EncodeDisaggregation | None:
        """The wire's encode disaggregation, or None for a wire without it (the default)."""
        return None


class VllmAdapter(WireAdapter):
    """``vllm.grpc.engine.VllmEngine`` (:mod:`mmgate.engines.vllm`).  PD: the prefill leg first (one token,
    ``kv_transfer_params_json`` ``do_remote_decode``), then the decode leg with the params it answered and
    the media's identity only (:func:`mmgate.engines.vllm.build_decode_request`)."""

    wire = Wire.VLLM
    response_type = vllm_engine_pb2.GenerateResponse
    media_refs = True
    roles = frozenset({Role.SINGLE, Role.PREFILL, Role.DECODE})
    sequential_pd = True
    pd_n_samples = False

    def encode(self, prepared: PreparedRequest, role: Role, plan: WirePlan, lease: ShmLease | None,
               bootstrap: Bootstrap | None = None, kv_transfer_params: str | None = None,
               language_model_only: bool = False) -> EncodedRequest:
        self.check_role(role)
        if role is Role.DECODE:
            return EncodedRequest(vllm.build_decode_request(prepared, kv_transfer_params,
                                                            grids=not language_model_only).SerializeToString())
        if role is Role.PREFILL:
            return vllm.encode_generate_request(prepared, plan, lease,
                                                kv_transfer_params or vllm.PREFILL_KV_TRANSFER_PARAMS)
        return vllm.encode_generate_request(prepared, plan, lease)

    def encode_media_refs(self, prepared: PreparedRequest, refs: Sequence[MediaRef]) -> EncodedRequest:
        return EncodedRequest(vllm.build_media_ref_request(prepared, refs).SerializeToString())

    def events(self, response: vllm_engine_pb2.GenerateResponse) -> list[EngineEvent]:
        return vllm.events(response)


class SglangAdapter(WireAdapter):
    """``sglang.grpc.scheduler.SglangScheduler`` (:mod:`mmgate.engines.sglang`; docs/engines-sglang.md)."""

    wire = Wire.SGLANG
    response_type = sglang_scheduler_pb2.GenerateResponse
    shm = False  # SGLang's TensorData carries inline bytes only
    roles = frozenset({Role.SINGLE, Role.PREFILL, Role.DECODE})

    def encode(self, prepared: PreparedRequest, role: Role, plan: WirePlan, lease: ShmLease | None,
               bootstrap: Bootstrap | None = None, kv_transfer_params: str | None = None,
               language_model_only: bool = False) -> EncodedRequest:
        self.check_role(role)
        return sglang.encode_generate_request(prepared, role, bootstrap, plan.encoder_dtype)

    def events(self, response: sglang_scheduler_pb2.GenerateResponse) -> list[EngineEvent]:
        return sglang.events(response)

    def map_error(self, exc: grpc.RpcError) -> GatewayError:
        return sglang.map_rpc_error(exc)


class TokenSpeedAdapter(WireAdapter):
    """``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` (:mod:`mmgate.engines.tokenspeed`;
    docs/engines-tokenspeed.md).  Items are sliced per item, so pending pixels are computed first."""

    wire = Wire.TOKENSPEED
    response_type = tokenspeed_scheduler_pb2.GenerateResponse
    roles = frozenset({Role.SINGLE, Role.PREFILL, Role.DECODE})
    places_pending = False

    async def materialize(self, prepared: PreparedRequest) -> PreparedRequest:
        return await tokenspeed.materialize(prepared)

    def plan(self, transport: TransportSettings, labels: Mapping[str, str]) -> WirePlan:
        """The common plan, with the environment's per-modality encoder dtypes ahead of the worker's label
        (``SMG_TOKENSPEED_{IMAGE,VIDEO,AUDIO}_ENCODER_INPUT_DTYPE``, ``SMG_TOKENSPEED_ENCODER_INPUT_DTYPE``:
        :func:`mmgate.config.settings.tokenspeed_encoder_dtypes`)."""
        return replace(super().plan(transport, labels), modality_encoder_dtypes=tuple(
            (Modality(modality), EncoderDtype(dtype)) for modality, dtype in transport.tokenspeed_encoder_dtypes))

    def build(self, prepared: PreparedRequest, role: Role, plan: WirePlan, lease: ShmLease | None,
              bootstrap: Bootstrap | None = None, kv_transfer_params: str | None = None) -> Any:
        return tokenspeed.build_generate_request(prepared, role, plan, lease, bootstrap)

    def events(self, response: tokenspeed_scheduler_pb2.GenerateResponse) -> list[EngineEvent]:
        return tokenspeed.events(response)

    # --- encode disaggregation (EPD; routing/disagg.py, docs/disaggregation.md) ---

    def epd(self) -> EncodeDisaggregation:
        return self

    #: the encoder service's unary call: one item per RPC (``tokenspeed_encoder.proto``)
    ENCODE_METHOD = "/tokenspeed.grpc.encoder.TokenSpeedEncoder/Encode"

    def encode_rpc(self) -> tuple[str, Callable[[bytes], Any]]:
        """(method path, response parser) of the ``Encode`` call of an encode worker."""
        return self.ENCODE_METHOD, tokenspeed_encoder_pb2.EncodeResponse.FromString

    def item_hashes(self, prepared: PreparedRequest) -> list[str]:
        """Each item's content hash, in prompt order (what ``--encode-policy consistent_hashing`` keys on)."""
        return [batch.mm_hashes[index] for batch, index in tokenspeed.prompt_items(prepared)]

    def encode_item(self, prepared: PreparedRequest, index: int, bootstrap: Bootstrap, plan: WirePlan,
                    lease: ShmLease | None) -> EncodedRequest:
        """The ``EncodeRequest`` of item ``index`` (materialized tensors) for its encode worker."""
        return EncodedRequest(tokenspeed.build_encode_request(prepared, index, bootstrap, plan, lease)
                              .SerializeToString())

    def encode_epd_prefill(self, prepared: PreparedRequest, plan: WirePlan, lease: ShmLease | None,
                           bootstrap: Bootstrap, encode_bootstrap: Sequence[Bootstrap]) -> EncodedRequest:
        """The prefill leg of an EPD request: items without encoder input, ``encode_bootstrap_info`` per item."""
        return EncodedRequest(tokenspeed.build_generate_request(prepared, Role.PREFILL, plan, lease, bootstrap,
                                                                encode_bootstrap).SerializeToString())


#: the wires this gateway can send requests to (a detected worker of another wire is never selected)
ADAPTERS: Mapping[Wire, WireAdapter] = {
    Wire.VLLM: VllmAdapter(),
    Wire.SGLANG: SglangAdapter(),
    Wire.TOKENSPEED: TokenSpeedAdapter(),
}


def adapter_for(wire: Wire | str | None) -> WireAdapter | None:
    """The adapter of ``wire``, or None (unknown wire, or none registered for it)."""
    if not wire:
        return None
    try:
        return ADAPTERS.get(Wire(wire))
    except ValueError:
        return None

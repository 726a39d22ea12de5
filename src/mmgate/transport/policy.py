"""Per-worker wire plan: which tensors go through shared memory, in which dtype.

Stage: assemble (after worker selection).  In: the gateway's
:class:`~mmgate.config.settings.TransportSettings` and the selected worker's labels;
out: a :class:`WirePlan` the engine adapter applies tensor by tensor.

* transport ``inline``: every tensor inline; ``shm``: every tensor of at least
  ``shm_min_bytes`` through shared memory; ``auto``: as ``shm`` but only when
  the worker's ``shm_namespace_id`` equals ours (same ``/dev/shm``).
* encoder dtype ``auto``: the worker's ``multimodal_encoder_dtype`` label when it
  names bfloat16/float16, else float32; an explicit setting wins.
* ``mm_device_do_normalize`` label ``true``: the worker rescales and normalizes
  on device, so the pipeline sends raw uint8 pixels (already patchified).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mmgate.config.settings import TensorTransport, TransportSettings
from mmgate.transport.dtypes import EncoderDtype
from mmgate.transport.shm import shm_namespace_id
from mmgate.types import Modality


@dataclass(frozen=True, slots=True)
class WirePlan:
    """How one request's tensors travel to the chosen worker."""

    shm: bool  # shared memory allowed for this worker
    shm_min_bytes: int
    encoder_dtype: EncoderDtype
    device_normalize: bool  # send uint8 pixels; the worker normalizes
    #: per-modality encoder dtypes that take precedence over ``encoder_dtype`` (TokenSpeed's environment
    #: overrides, set by its adapter's plan): (modality, dtype) pairs
    modality_encoder_dtypes: tuple[tuple[Modality, EncoderDtype], ...] = ()

    def encoder_dtype_for(self, modality: Modality) -> EncoderDtype:
        """The wire dtype of ``modality``'s encoder input: its override, else ``encoder_dtype``."""
        return dict(self.modality_encoder_dtypes).get(modality, self.encoder_dtype)

    def use_shm(self, nbytes: int) -> bool:
        return self.shm and nbytes >= self.shm_min_bytes


INLINE_FLOAT32 = WirePlan(shm=False, shm_min_bytes=0, encoder_dtype=EncoderDtype.FLOAT32, device_normalize=False)


def wire_plan(settings: TransportSettings, labels: Mapping[str, str]) -> WirePlan:
    """The plan for a worker with ``labels`` under ``settings``."""
    if settings.tensor_transport is TensorTransport.SHM:
        shm = True
    elif settings.tensor_transport is TensorTransport.AUTO:
        ours = shm_namespace_id()
        shm = bool(ours) and labels.get("shm_namespace_id", "") == ours
    else:
        shm = False
    if settings.encoder_dtype == "auto":
        label = labels.get("multimodal_encoder_dtype", "").removeprefix("torch.")
        dtype = EncoderDtype(label) if label in ("bfloat16", "float16") else EncoderDtype.FLOAT32
    else:
        dtype = EncoderDtype(settings.encoder_dtype)
    return WirePlan(shm=shm, shm_min_bytes=settings.shm_min_bytes, encoder_dtype=dtype,
                    device_normalize=labels.get("mm_device_do_normalize", "false") == "true")

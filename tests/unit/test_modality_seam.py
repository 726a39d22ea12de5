"""The modality seam (issue 23): families map modalities to processors, one anchor check serves the
pipeline and worker-side forwarding, audio references reach vLLM workers through the matrix's refs row, and
the audio source hands the processor's rate and the audio limits to the decoder."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from mmgate.config.settings import AudioSettings, FetchSettings, Settings
from mmgate.engines.base import Capabilities, Role, Wire
from mmgate.engines.capabilities import MATRIX, REFS_MATRIX, MediaKind, takes, takes_refs
from mmgate.errors import ERROR_TABLE, ErrorCode, GatewayError
from mmgate.media.fetch import MediaFetcher
from mmgate.models.family import processor, processor_map
from mmgate.pipeline.planning import check_anchors
from mmgate.pipeline.sources import AudioSource, SourceContext
from mmgate.request.protocol import AudioPart, AudioURL, AudioURLPart, ImagePart, ImageURL, InputAudio
from mmgate.routing.mm_processing import forwardable
from mmgate.types import DecodedAudio, MediaRef, Modality


@dataclass
class Proc:
    """A processor by its seam attributes (anchor ids chosen for the test)."""

    modality: Modality
    anchor_token_id: int
    sampling_rate: int = 16000
    fingerprint: str = "stand-in"


@dataclass
class Fam:
    procs: tuple[Proc, ...]
    model_types: tuple[str, ...] = ("stand_in",)
    processors: dict[Modality, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.processors = processor_map(*self.procs)  # type: ignore[arg-type]


IMAGE, VIDEO, AUDIO = Proc(Modality.IMAGE, 7), Proc(Modality.VIDEO, 8), Proc(Modality.AUDIO, 9)


def ref(modality: Modality, i: int = 0, url: str = "data:x;base64,AA==") -> MediaRef:
    return MediaRef(modality=modality, url=url, part_index=i, param=f"messages[0].content[{i}]")


def test_a_family_maps_each_modality_to_its_processor_and_refuses_the_others() -> None:
    fam = Fam((IMAGE, AUDIO))
    assert processor(fam, Modality.AUDIO) is AUDIO  # type: ignore[arg-type]
    with pytest.raises(GatewayError) as err:
        processor(fam, Modality.VIDEO)  # type: ignore[arg-type]
    assert err.value.code is ErrorCode.MULTIMODAL_NOT_SUPPORTED


def test_the_one_anchor_check_counts_every_modality_the_family_takes() -> None:
    fam = Fam((IMAGE, VIDEO, AUDIO))
    refs = [ref(Modality.IMAGE, 0), ref(Modality.AUDIO, 1), ref(Modality.AUDIO, 2)]
    check_anchors([1, 7, 2, 9, 9, 3], refs, fam)  # type: ignore[arg-type]
    with pytest.raises(GatewayError) as err:  # one audio anchor short
        check_anchors([1, 7, 2, 9, 3], refs, fam)  # type: ignore[arg-type]
    assert err.value.code is ErrorCode.MEDIA_COUNT_MISMATCH and "1 audio anchors for 2 audios" in err.value.message
    with pytest.raises(GatewayError) as err:  # a video anchor with no video item
        check_anchors([7, 9, 9, 8], refs, fam)  # type: ignore[arg-type]
    assert err.value.code is ErrorCode.MEDIA_COUNT_MISMATCH and "video" in err.value.message


def test_the_anchor_check_refuses_a_modality_the_family_lacks_and_media_for_text_only_models() -> None:
    with pytest.raises(GatewayError) as err:
        check_anchors([9], [ref(Modality.AUDIO)], Fam((IMAGE,)))  # type: ignore[arg-type]
    assert err.value.code is ErrorCode.MULTIMODAL_NOT_SUPPORTED
    with pytest.raises(GatewayError) as err:
        check_anchors([7], [ref(Modality.IMAGE)], None)
    assert err.value.code is ErrorCode.MULTIMODAL_NOT_SUPPORTED and err.value.param == "messages[0].content[0]"


def caps(wire: Wire, *modalities: Modality) -> Capabilities:
    return Capabilities(wire=wire, role=Role.SINGLE, modalities=frozenset(modalities))


def test_audio_is_taken_router_side_by_tokenspeed_only() -> None:
    assert [w for w in Wire if MediaKind.AUDIO in MATRIX[w]] == [Wire.TOKENSPEED]
    assert takes(caps(Wire.TOKENSPEED, Modality.IMAGE, Modality.AUDIO), MediaKind.AUDIO)
    assert not takes(caps(Wire.VLLM, Modality.IMAGE, Modality.VIDEO), MediaKind.AUDIO)


def test_audio_references_are_taken_by_vllm_workers_only() -> None:
    """The refs row: a vLLM worker's own processor takes audio references (its vision flag does not
    matter for audio); image references still need a model that takes images; other wires take none."""
    assert [w for w in Wire if MediaKind.AUDIO in REFS_MATRIX[w]] == [Wire.VLLM]
    assert takes_refs(caps(Wire.VLLM, Modality.IMAGE, Modality.VIDEO), [Modality.AUDIO, Modality.IMAGE])
    assert takes_refs(caps(Wire.VLLM), [Modality.AUDIO])
    assert not takes_refs(caps(Wire.VLLM), [Modality.IMAGE])
    for wire in (Wire.SGLANG, Wire.TOKENSPEED):
        assert not takes_refs(caps(wire, Modality.IMAGE, Modality.VIDEO, Modality.AUDIO), [Modality.AUDIO])


def test_audio_parts_are_forwardable_as_references_and_their_format_is_not_a_hint() -> None:
    parts = [AudioPart(InputAudio(data="AA==", format="mp3")), AudioURLPart(AudioURL(url="https://a/b.wav")),
             ImagePart(ImageURL(url="https://a/b.png"))]
    assert forwardable(parts)
    assert not forwardable(parts, text_updates=frozenset({Modality.AUDIO}))
    assert not forwardable([ImagePart(ImageURL(url="https://a/b.png", max_long_side_pixel=64))])


def test_input_audio_becomes_a_data_url_of_its_container() -> None:
    assert InputAudio(data="UklGRg==", format="mp3").data_url() == "data:audio/mpeg;base64,UklGRg=="
    assert InputAudio(data="UklGRg==").data_url() == "data:audio/wav;base64,UklGRg=="


def test_the_audio_error_codes_are_stable_caller_errors() -> None:
    codes = {c.value: ERROR_TABLE[c].status for c in ErrorCode if c.value.startswith("audio_")}
    assert codes == {"audio_decode_failed": 400, "audio_no_stream": 400, "audio_empty": 400,
                     "audio_too_long": 413, "audio_decode_timeout": 413, "audio_too_short": 400}


def test_the_audio_source_decodes_each_distinct_clip_once_at_the_processors_rate() -> None:
    """The seam the audio decoder plugs into: ``decode(data, target_rate, limits)``, one call per distinct
    URL, the refusal renamed to the item's part."""
    calls: list[tuple[bytes, int, AudioSettings]] = []

    def decode(data: bytes, rate: int, limits: AudioSettings) -> DecodedAudio:
        calls.append((data, rate, limits))
        if data == b"bad":
            raise GatewayError(ErrorCode.AUDIO_DECODE_FAILED, "audio could not be decoded")
        return DecodedAudio(samples=np.zeros(rate // 10, np.float32), sampling_rate=rate, source_rate=44100,
                            source_channels=2, content_hash="h", num_bytes=len(data))

    limits = AudioSettings(max_duration_s=12.0, decode_timeout_s=3.0)
    settings = Settings(model="m", audio=limits)
    with ThreadPoolExecutor(1) as pool:
        ctx = SourceContext(MediaFetcher(FetchSettings()), pool, settings)
        a, b = "data:audio/wav;base64,UklGRg==", "data:audio/wav;base64,YmFk"
        out = asyncio.run(AudioSource(decode).load(ctx, Proc(Modality.AUDIO, 9, 24000),  # type: ignore[arg-type]
                                                   [ref(Modality.AUDIO, 0, a), ref(Modality.AUDIO, 1, a)]))
        assert out[0] is out[1] and out[0].sampling_rate == 24000 and out[0].duration_s == pytest.approx(0.1)
        assert calls == [(b"RIFF", 24000, limits)]
        with pytest.raises(GatewayError) as err:
            asyncio.run(AudioSource(decode).load(ctx, Proc(Modality.AUDIO, 9),  # type: ignore[arg-type]
                                                 [ref(Modality.AUDIO, 0, a), ref(Modality.AUDIO, 3, b)]))
    assert err.value.code is ErrorCode.AUDIO_DECODE_FAILED and err.value.param == "messages[0].content[3]"

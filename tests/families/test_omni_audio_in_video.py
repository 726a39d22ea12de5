"""``use_audio_in_video: true`` for Qwen2.5-Omni and Qwen3-Omni against the transformers 5.24 processors.

A clip with an audio track (h264 frames + an aac tone in one mp4, made with PyAV here) goes through
``Pipeline.prepare`` with ``mm_processor_kwargs: {"use_audio_in_video": true}``.  The reference is the model's
own processor (``AutoProcessor``) given the same frames (its pyav loader, sampled as a vLLM worker samples them:
tests/video/video_support.py) and the same waveform (what mmgate's audio decoder made of the mp4's track, as the
processor takes pre-decoded tracks: ``audio`` with ``audio_from_video_indices``; its own loader needs
torchcodec), called with ``use_audio_in_video=True``:

* ``input_ids`` identical: ``<vision start><audio start>`` the interleaved video/audio pad run
  ``<audio end><vision end>``;
* ``pixel_values_videos``, ``video_grid_thw``, ``video_second_per_grid`` identical;
* the track's ``input_features`` (valid frames) and mask identical, the track an audio item of its own;
* the placeholder ranges: the clip's spans the interleaved run, the track's from its first to its last audio
  token, and the engine's embedding runs of each are exactly its own tokens.

A clip without an audio stream keeps its plain run, as the reference (``video_to_audio_indices`` None).
"""

from __future__ import annotations

import base64
import copy
import warnings
from pathlib import Path

import av
import numpy as np
import pytest

from mmgate.engines.wire_values import embedding_runs
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.backend import FrameSampling
from mmgate.types import Modality, PreparedRequest
from tests.support.av_clips import av_clip, track
from tests.video.video_support import load, prepare, processor, video_part, vllm_video_kwargs

OMNI = ("Qwen/Qwen2.5-Omni-7B", "Qwen/Qwen3-Omni-30B-A3B-Instruct")
TEXT = "What happens?"


def wav_part(samples: np.ndarray) -> dict:
    from tests.audio.clips import encode

    data = encode(samples[None, :], "wav", 16000)
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def reference(model: str, path: Path, audio: list[np.ndarray], from_video: list[int | None],
              content: list[dict]) -> dict[str, np.ndarray]:
    """The processor with ``use_audio_in_video=True`` on the clip's frames and the given tracks."""
    proc = processor(model)
    frames, meta = load(path)
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(text=[prompt], videos=[frames], video_metadata=[copy.deepcopy(meta)], audio=audio or None,
                   audio_from_video_indices=from_video, use_audio_in_video=True, return_tensors="np",
                   videos_kwargs={"cap_pixels_per_frame": False, **vllm_video_kwargs(model)})
    return dict(out)


def runs_of(prepared: PreparedRequest, modality: Modality) -> list[tuple[int, int]]:
    batch = next(b for b in prepared.batches if b.modality is modality)
    return [(r.offset, r.length) for r in embedding_runs(prepared.input_ids, batch.placeholder_token_id,
                                                         batch.placeholders, whole_span_when_empty=False)]


def token_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each maximal run of ``token`` in ``ids``."""
    out: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == token:
            if out and out[-1][0] + out[-1][1] == i:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((i, 1))
    return out


def check_video(prepared: PreparedRequest, ref: dict[str, np.ndarray]) -> None:
    video = next(b for b in prepared.batches if b.modality is Modality.VIDEO)
    assert np.array_equal(video.tensors["pixel_values"], ref["pixel_values_videos"])
    assert np.array_equal(video.tensors["video_grid_thw"], ref["video_grid_thw"])
    assert np.array_equal(video.tensors["video_second_per_grid"],
                          np.asarray(ref["video_second_per_grid"], dtype=np.float32))


def check_audio(prepared: PreparedRequest, ref: dict[str, np.ndarray], model: str, clips: list[np.ndarray]) -> None:
    """The audio batch (standalone clips and tracks, one extractor call that pads them to the longest) equals the
    processor's: lengths, mask and each item's valid frames."""
    audio = next(b for b in prepared.batches if b.modality is Modality.AUDIO)
    feats, mask = audio.tensors["input_features"], audio.tensors["feature_attention_mask"]
    lengths = audio.tensors["audio_feature_lengths"]
    assert len(lengths) == len(clips)
    assert lengths.tolist() == ref["feature_attention_mask"].sum(-1).tolist()
    assert np.array_equal(mask, ref["feature_attention_mask"][:, :mask.shape[1]])
    for k in range(len(clips)):
        valid = int(lengths[k])
        assert np.array_equal(feats[k, :, :valid], ref["input_features"][k][:, :valid]), f"track {k}"


@pytest.mark.parametrize("model", OMNI, ids=lambda m: m.split("/")[1])
@pytest.mark.parametrize("seconds", [4.1, 1.2])
def test_a_clip_with_its_audio_track_equals_the_processor(model: str, seconds: float, tmp_path: Path) -> None:
    path = av_clip(tmp_path, "tone", seconds)
    prepared = prepare(model, [video_part(path)], TEXT, kwargs={"use_audio_in_video": True})
    wave = track(path)
    ref = reference(model, path, [wave], [0], [{"type": "video"}, {"type": "text", "text": TEXT}])
    assert list(prepared.input_ids) == ref["input_ids"][0].tolist()
    check_video(prepared, ref)
    check_audio(prepared, ref, model, [wave])

    proc = processor(model)
    ids = list(prepared.input_ids)
    video = next(b for b in prepared.batches if b.modality is Modality.VIDEO)
    audio = next(b for b in prepared.batches if b.modality is Modality.AUDIO)
    start = ids.index(proc.tokenizer.convert_tokens_to_ids(proc.audio_bos_token))
    end = ids.index(proc.tokenizer.convert_tokens_to_ids(proc.audio_eos_token))
    assert [(p.offset, p.length) for p in video.placeholders] == [(start + 1, end - start - 1)]
    first_audio = ids.index(proc.audio_token_id)
    last_audio = len(ids) - 1 - ids[::-1].index(proc.audio_token_id)
    assert [(p.offset, p.length) for p in audio.placeholders] == [(first_audio, last_audio + 1 - first_audio)]
    # what an engine embeds of each range: exactly its own pad tokens, interleaved
    assert runs_of(prepared, Modality.VIDEO) == token_runs(ids, proc.video_token_id)
    assert runs_of(prepared, Modality.AUDIO) == token_runs(ids, proc.audio_token_id)
    assert len(token_runs(ids, proc.audio_token_id)) > 1 or seconds < 2
    assert [p.modality for p in prepared.plans] == [Modality.VIDEO, Modality.AUDIO]


def test_a_track_muxed_in_mpeg_ts_is_found(tmp_path: Path) -> None:
    """A clip's track is read with the video decoder's demuxers and stream probing, not the audio parts' (whose
    whitelist has no MPEG-TS, and whose 2 KiB probe is sized for audio files; MPEG-TS announces its streams in
    packets, not in a header).  transformers' pyav loader
    cannot read the clip (no frame count in the header), so every frame goes to both sides
    (``--video-frame-sampling transformers``: the processor's own default fps) as PyAV decodes them."""
    model = OMNI[0]
    path = av_clip(tmp_path, "muxed", 2.5, container="mpegts")
    prepared = prepare(model, [video_part(path)], TEXT, sampling=FrameSampling.TRANSFORMERS,
                       kwargs={"use_audio_in_video": True})
    with av.open(str(path)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    proc = processor(model)
    content = [{"type": "video"}, {"type": "text", "text": TEXT}]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    wave = track(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = dict(proc(text=[prompt], videos=[frames], audio=[wave], audio_from_video_indices=[0],
                        use_audio_in_video=True, return_tensors="np",
                        videos_kwargs={"do_sample_frames": False, "cap_pixels_per_frame": False}))
    assert list(prepared.input_ids) == ref["input_ids"][0].tolist()
    assert proc.audio_token_id in prepared.input_ids
    check_video(prepared, ref)
    check_audio(prepared, ref, model, [wave])


@pytest.mark.parametrize("model", OMNI, ids=lambda m: m.split("/")[1])
def test_an_audio_part_and_a_clip_s_track_keep_the_prompt_order(model: str, tmp_path: Path) -> None:
    path = av_clip(tmp_path, "tone", 2.3)
    part = (0.25 * np.sin(np.arange(int(0.9 * 16000)) / 16000 * 2 * np.pi * 300)).astype(np.float32)
    prepared = prepare(model, [wav_part(part), video_part(path)], TEXT, kwargs={"use_audio_in_video": True})
    wave = track(path)
    given = track_of_wav(part)
    ref = reference(model, path, [given, wave], [None, 0],
                    [{"type": "audio"}, {"type": "video"}, {"type": "text", "text": TEXT}])
    assert list(prepared.input_ids) == ref["input_ids"][0].tolist()
    check_video(prepared, ref)
    check_audio(prepared, ref, model, [given, wave])
    assert runs_of(prepared, Modality.AUDIO) == token_runs(list(prepared.input_ids), processor(model).audio_token_id)


def track_of_wav(samples: np.ndarray) -> np.ndarray:
    """The part's samples after mmgate's decoder (a 16 kHz s16 wav: quantized)."""
    from mmgate.media.audio import decode_audio
    from tests.audio.clips import encode

    data = encode(samples[None, :], "wav", 16000)
    return decode_audio(data, 16000, max_input_bytes=1 << 30, max_duration_s=600.0, timeout_s=30.0).samples


@pytest.mark.parametrize("model", OMNI, ids=lambda m: m.split("/")[1])
def test_a_silent_clip_keeps_its_plain_run(model: str, tmp_path: Path) -> None:
    path = av_clip(tmp_path, "silent", 2.0, rate=None)
    prepared = prepare(model, [video_part(path)], TEXT, kwargs={"use_audio_in_video": True})
    ref = reference(model, path, [], [], [{"type": "video"}, {"type": "text", "text": TEXT}])
    assert "input_features" not in ref
    assert list(prepared.input_ids) == ref["input_ids"][0].tolist()
    assert [b.modality for b in prepared.batches] == [Modality.VIDEO]
    check_video(prepared, ref)
    plain = prepare(model, [video_part(path)], TEXT)
    assert plain.input_ids == prepared.input_ids


@pytest.mark.parametrize("model", OMNI, ids=lambda m: m.split("/")[1])
def test_false_is_the_plain_run_and_bad_values_are_refused(model: str, tmp_path: Path) -> None:
    path = av_clip(tmp_path, "tone", 1.2)
    off = prepare(model, [video_part(path)], TEXT, kwargs={"use_audio_in_video": False})
    assert [b.modality for b in off.batches] == [Modality.VIDEO]
    assert processor(model).audio_token_id not in off.input_ids
    for bad in ("true", 1):
        with pytest.raises(GatewayError) as err:
            prepare(model, [video_part(path)], TEXT, kwargs={"use_audio_in_video": bad})
        assert err.value.code is ErrorCode.INVALID_REQUEST
        assert err.value.param == "mm_processor_kwargs.use_audio_in_video"


def test_the_track_hashes_apart_from_its_clip(tmp_path: Path) -> None:
    """One clip's bytes give a video and an audio item; their hashes (content hash + each processor's
    fingerprint) differ, so neither takes the other's cache entry or encoder output."""
    path = av_clip(tmp_path, "tone", 1.2)
    prepared = prepare(OMNI[1], [video_part(path)], TEXT, kwargs={"use_audio_in_video": True})
    video, audio = (next(b for b in prepared.batches if b.modality is m) for m in (Modality.VIDEO, Modality.AUDIO))
    assert len(video.mm_hashes) == len(audio.mm_hashes) == 1 and video.mm_hashes != audio.mm_hashes


@pytest.mark.parametrize("model", OMNI, ids=lambda m: m.split("/")[1])
def test_the_interleaving_is_the_processor_s_for_every_geometry(model: str) -> None:
    """:data:`~mmgate.models.qwen_omni_video.INTERLEAVE` against the processor's own
    ``replace_video_with_audio_token`` (called with its class defaults ``position_id_per_seconds`` and
    ``seconds_per_chunk``) over clip lengths, frame sizes, both ``video_second_per_grid`` values mmgate sends
    (1.0 and 2.0) and one that skips chunks (4.0), and tracks shorter and longer than the frames."""
    from mmgate.models.qwen_omni_video import INTERLEAVE

    proc = processor(model)
    merge = proc.video_processor.merge_size
    model_type = "qwen2_5_omni" if "2.5" in model else "qwen3_omni_moe"
    vid, aid = proc.video_token_id, proc.audio_token_id
    kwargs = {"position_id_per_seconds": type(proc).position_id_per_seconds,
              "seconds_per_chunk": type(proc).seconds_per_chunk}
    for grid_t in (1, 2, 5, 16):
        for h, w in ((2, 2), (4, 6)):
            for spg in (1.0, 2.0, 4.0):
                for audio_tokens in (1, 13, 50, 51, 130, 777):
                    ref = proc.replace_video_with_audio_token(
                        {"video_grid_thw": np.array([[grid_t, h, w]]), "video_second_per_grid": [spg]}, 0,
                        {"num_audio_tokens": np.array([audio_tokens])}, 0, **kwargs)
                    runs = INTERLEAVE[model_type](grid_t, (h // merge) * (w // merge), spg, audio_tokens, vid, aid)
                    ids = [tid for tid, count in runs for _ in range(count)]
                    expected = proc.tokenizer.encode(ref, add_special_tokens=False)
                    assert [expected[0], *ids, expected[-1]] == expected, (grid_t, h, w, spg, audio_tokens)

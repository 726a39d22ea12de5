"""The reference engine runs Qwen2.5-Omni's and Qwen3-Omni's thinkers and Qwen3-ASR on the TokenSpeed wire.

Each request is built by hand from the transformers 5.24 processor's own output (never mmgate gateway
code) for generated waveforms (and an image for the Omni models): the expanded ``input_ids``, one
``MultimodalItem`` per clip in prompt order with ``encoder_input`` = the clip's valid log-mel frames
``[mel, valid]`` and ``feature_attention_mask`` / ``audio_feature_lengths`` as side tensors (what smg's
``assemble_tokenspeed_with_options`` and TokenSpeed's ``qwen3_audio.py`` carry), the image as its
patch rows and grid.  It travels over real gRPC on loopback to an engine started in process with
``--record-dir``; the recording is what the model's forward received, compared bit for bit with the
processor's tensors; and the streamed greedy ids equal transformers' own ``model.generate`` on the
processor's whole output (Qwen2.5-Omni's clips padded to 30000 frames included) with the same
seeded weights, so the engine feeds the model exactly what its processor would.  Also: the audio
modality advertised per model, an smg-shaped bfloat16 item (``[1, mel, max_frames]`` + mask), an
image to the audio-only model, and the vLLM wire's refusal of a preprocessed audio batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from smg_grpc_proto.generated import common_pb2, tokenspeed_scheduler_pb2_grpc, vllm_engine_pb2
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

from mmgate.engines.base import Wire
from mmgate.refengine.bundle import LoadedModel, load_model
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from mmgate.transport.inline import to_tensor_data
from tests.refengine.refengine_support import processor_for, random_image, require_bundle, stub_for

QWEN2_5_OMNI = "Qwen--Qwen2.5-Omni-7B"
QWEN3_OMNI = "Qwen--Qwen3-Omni-30B-A3B-Instruct"
QWEN3_ASR = "Qwen--Qwen3-ASR-0.6B"
SR = 16_000
_OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]


def waveform(samples: int, seed: int) -> np.ndarray:
    """A tone plus noise, float32 mono at 16 kHz."""
    t = np.arange(samples, dtype=np.float64) / SR
    noise = np.random.default_rng(seed).standard_normal(samples) * 0.05
    return (0.3 * np.sin(2 * np.pi * (220 + 110 * seed) * t) + noise).astype(np.float32)


#: two clips whose sample counts are not multiples of the hop (160): 2.0023 s and 1.0003 s
CLIPS = (waveform(2 * SR + 37, 1), waveform(SR + 5, 2))


def tensor(array: np.ndarray, dtype: str | None = None) -> pb.TensorData:
    """A TokenSpeed ``TensorData`` with the array inline (bfloat16 as raw 16-bit patterns)."""
    if dtype == "bfloat16":
        bits = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(torch.bfloat16).view(torch.int16)
        return pb.TensorData(shape=list(array.shape), dtype="bfloat16", inline=bits.numpy().tobytes())
    td = to_tensor_data(np.ascontiguousarray(array))
    return pb.TensorData(shape=list(td.shape), dtype=td.dtype, inline=td.inline)


def runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of ``token`` in ``ids``."""
    out: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def audio_item(features: np.ndarray, valid: int, run: tuple[int, int], token: int, tag: str) -> pb.MultimodalItem:
    """One clip as the wire carries it: its valid frames ``[mel, valid]``, mask ``[1, valid]``, lengths ``[1]``."""
    return pb.MultimodalItem(
        modality=common_pb2.AUDIO, content_hash=tag.encode().ljust(32, b"\0"),
        encoder_input=tensor(np.ascontiguousarray(features[:, :valid], dtype=np.float32)),
        model_specific_tensors={"feature_attention_mask": tensor(np.ones((1, valid), np.int64)),
                                "audio_feature_lengths": tensor(np.array([valid], np.int64))},
        placeholders=[pb.PlaceholderRange(offset=run[0], length=run[1])], placeholder_token_id=token)


def image_item(pixel_values: np.ndarray, grid: np.ndarray, run: tuple[int, int], token: int) -> pb.MultimodalItem:
    return pb.MultimodalItem(
        modality=common_pb2.IMAGE, content_hash=b"image".ljust(32, b"\0"),
        encoder_input=tensor(np.ascontiguousarray(pixel_values, dtype=np.float32)),
        model_specific_tensors={"image_grid_thw": tensor(np.ascontiguousarray(grid, dtype=np.int64))},
        placeholders=[pb.PlaceholderRange(offset=run[0], length=run[1])], placeholder_token_id=token)


def generate_request(request_id: str, ids: list[int], items: list[pb.MultimodalItem]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id, tokenized=pb.TokenizedInput(input_ids=ids), stream=True,
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True),
        mm_inputs=pb.MultimodalInputs(items=items))


STEPS = 4


@cache
def reference_model(name: str) -> LoadedModel:
    """The engine's model rebuilt in process: the same seed gives the same weights."""
    return load_model(EngineConfig(model=require_bundle(name), port=0))


def transformers_greedy(name: str, out: dict[str, np.ndarray]) -> list[int]:
    """``model.generate`` on the processor's whole output (greedy, :data:`STEPS` tokens)."""
    inputs = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}
    with torch.inference_mode():
        ids = reference_model(name).model.generate(**inputs, max_new_tokens=STEPS, do_sample=False)
    return ids[0, inputs["input_ids"].shape[1]:].tolist()


class Engines:
    """TokenSpeed engines (one per bundle, recording every request) and their stubs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.running: dict[str, RunningEngine] = {}

    def get(self, name: str) -> RunningEngine:
        if name not in self.running:
            self.running[name] = start_engine(EngineConfig(model=require_bundle(name), port=0, wire=Wire.TOKENSPEED,
                                                           record_dir=self.root / name))
        return self.running[name]

    def stub(self, name: str) -> tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerStub:
        return tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerStub(
            grpc.insecure_channel(self.get(name).address, options=_OPTIONS))

    def generate(self, name: str, request: pb.GenerateRequest) -> list[int]:
        """The streamed token ids (the answer streams one chunk per token, then a Complete)."""
        responses = list(self.stub(name).Generate(request, timeout=120))
        assert responses[-1].HasField("complete"), responses[-1]
        assert responses[-1].complete.prompt_tokens == len(request.tokenized.input_ids)
        return [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]

    def recorded(self, name: str, request_id: str) -> dict[str, np.ndarray]:
        with np.load(self.root / name / f"{request_id}.npz") as data:
            return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    out = Engines(tmp_path_factory.mktemp("audio-recordings"))
    yield out
    for engine in out.running.values():
        engine.stop(grace=0)


def omni_processor_output(name: str) -> tuple[dict[str, np.ndarray], int, int]:
    """The processor's tensors for [audio, image, audio, text] and the audio / image token ids."""
    processor = processor_for(require_bundle(name))
    conversation = [{"role": "user", "content": [{"type": "audio"}, {"type": "image"}, {"type": "audio"},
                                                 {"type": "text", "text": "What is said, and what is shown?"}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], audio=list(CLIPS), images=[random_image(64, 48)], return_tensors="np")
    tokenizer = processor.tokenizer
    return ({k: np.asarray(v) for k, v in out.items()}, tokenizer.convert_tokens_to_ids(processor.audio_token),
            tokenizer.convert_tokens_to_ids(processor.image_token))


def assert_features_exact(got: np.ndarray, got_mask: np.ndarray, want: np.ndarray, want_mask: np.ndarray) -> None:
    """``got`` holds each clip's valid frames bit for bit as the processor's and zeros after them; the
    mask equals the processor's over the frames sent (the processor's own padding beyond the longest
    clip is masked out before the tower and not reproduced)."""
    assert got.dtype == np.float32 and got_mask.dtype == want_mask.dtype == np.int32
    frames = got.shape[2]
    assert got.shape[:2] == want.shape[:2] and got_mask.shape == (want.shape[0], frames)
    np.testing.assert_array_equal(got_mask, want_mask[:, :frames])
    assert int(want_mask[:, frames:].sum()) == 0
    for clip, valid in enumerate(want_mask.sum(-1)):
        assert got[clip, :, :valid].tobytes() == want[clip, :, :valid].tobytes()
        assert not got[clip, :, valid:].any()


@pytest.mark.parametrize("name", [QWEN2_5_OMNI, QWEN3_OMNI])
def test_omni_thinker_takes_two_clips_and_an_image_as_the_processor_made_them(engines: Engines, name: str) -> None:
    out, audio_token, image_token = omni_processor_output(name)
    ids = [int(t) for t in out["input_ids"][0]]
    valid = [int(v) for v in out["feature_attention_mask"].sum(-1)]
    audio_runs, image_runs = runs(ids, audio_token), runs(ids, image_token)
    assert len(audio_runs) == 2 and len(image_runs) == 1 and audio_runs[0][0] < image_runs[0][0] < audio_runs[1][0]
    items = [audio_item(out["input_features"][0], valid[0], audio_runs[0], audio_token, "clip-0"),
             image_item(out["pixel_values"], out["image_grid_thw"], image_runs[0], image_token),
             audio_item(out["input_features"][1], valid[1], audio_runs[1], audio_token, "clip-1")]

    tokens = engines.generate(name, generate_request("omni", ids, items))

    assert tokens == transformers_greedy(name, out)
    got = engines.recorded(name, "omni")
    assert got["input_ids"].tolist() == [ids]
    assert_features_exact(got["input_features"], got["feature_attention_mask"], out["input_features"],
                          out["feature_attention_mask"])
    assert got["input_features"].shape[2] == max(valid)
    assert got["pixel_values"].tobytes() == np.ascontiguousarray(out["pixel_values"], np.float32).tobytes()
    np.testing.assert_array_equal(got["image_grid_thw"], out["image_grid_thw"])
    assert "audio_feature_lengths" not in got  # no processor hands it to the forward


def test_an_smg_shaped_bfloat16_clip_is_trimmed_to_its_valid_frames(engines: Engines) -> None:
    """smg sends ``[1, mel, max_frames_of_the_request]`` in bfloat16 with the mask and lengths of the clip;
    the engine keeps the valid frames (TokenSpeed ``pack_qwen3_audio_features``), cast to float32."""
    out, audio_token, _ = omni_processor_output(QWEN3_OMNI)
    processor = processor_for(require_bundle(QWEN3_OMNI))
    conversation = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Transcribe."}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    single = processor(text=[text], audio=[CLIPS[1]], return_tensors="np")
    ids = [int(t) for t in single["input_ids"][0]]
    valid = int(single["feature_attention_mask"].sum())
    padded_frames = valid + 23  # padding frames of a longer clip in the same request
    features = np.zeros((1, 128, padded_frames), np.float32)
    features[..., :valid] = single["input_features"][..., :valid]
    features[..., valid:] = 1.5  # whatever the gateway padded with: the engine must drop it
    mask = np.zeros((1, padded_frames), np.int64)
    mask[:, :valid] = 1
    (run,) = runs(ids, audio_token)
    item = pb.MultimodalItem(
        modality=common_pb2.AUDIO, content_hash=b"bf16".ljust(32, b"\0"), encoder_input=tensor(features, "bfloat16"),
        model_specific_tensors={"feature_attention_mask": tensor(mask), "audio_feature_lengths":
                                tensor(np.array([valid], np.int64))},
        placeholders=[pb.PlaceholderRange(offset=run[0], length=run[1])])

    assert len(engines.generate(QWEN3_OMNI, generate_request("bf16", ids, [item]))) == STEPS

    got = engines.recorded(QWEN3_OMNI, "bf16")
    want = torch.from_numpy(single["input_features"][..., :valid]).to(torch.bfloat16).float().numpy()
    assert got["input_features"].shape == (1, 128, valid)
    assert got["input_features"].tobytes() == want.tobytes()
    np.testing.assert_array_equal(got["feature_attention_mask"], np.ones((1, valid), np.int32))


def test_qwen3_asr_takes_the_clip_as_its_feature_extractor_pads_it(engines: Engines) -> None:
    """Qwen3-ASR's forward takes ``input_features_mask`` and a frame axis padded to a multiple of
    ``2 * n_window`` (100): the recording equals the processor's whole output, padding included."""
    processor = processor_for(require_bundle(QWEN3_ASR))
    conversation = [{"role": "user", "content": [{"type": "audio"}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    clip = waveform(24_800 + 77, 3)  # 155 valid frames, padded to 200
    out = {k: v.numpy() for k, v in processor(text=[text], audio=[clip], return_tensors="pt").items()}  # pt only
    ids = [int(t) for t in out["input_ids"][0]]
    audio_token = processor.tokenizer.convert_tokens_to_ids(processor.audio_token)
    valid = int(out["input_features_mask"].sum())
    assert valid == 155 and out["input_features"].shape == (1, 128, 200)
    (run,) = runs(ids, audio_token)

    tokens = engines.generate(QWEN3_ASR, generate_request(
        "asr", ids, [audio_item(out["input_features"][0], valid, run, audio_token, "asr")]))

    assert tokens == transformers_greedy(QWEN3_ASR, out)
    got = engines.recorded(QWEN3_ASR, "asr")
    assert got["input_ids"].tolist() == [ids]
    assert got["input_features"].tobytes() == np.ascontiguousarray(out["input_features"], np.float32).tobytes()
    assert got["input_features_mask"].dtype == out["input_features_mask"].dtype
    np.testing.assert_array_equal(got["input_features_mask"], out["input_features_mask"])
    assert "feature_attention_mask" not in got


@pytest.mark.parametrize(("name", "modalities", "vision"), [
    (QWEN2_5_OMNI, [common_pb2.IMAGE, common_pb2.VIDEO, common_pb2.AUDIO], True),
    (QWEN3_OMNI, [common_pb2.IMAGE, common_pb2.VIDEO, common_pb2.AUDIO], True),
    (QWEN3_ASR, [common_pb2.AUDIO], False),
])
def test_audio_is_advertised_for_the_models_that_take_it(engines: Engines, name: str, modalities: list[int],
                                                          vision: bool) -> None:
    info = engines.stub(name).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert list(info.supported_modalities) == modalities
    assert info.supports_vision is vision and info.supports_multimodal


def test_an_image_item_to_qwen3_asr_is_refused(engines: Engines) -> None:
    ids = [151644, 151655, 151655, 151645]
    item = image_item(np.zeros((8, 1176), np.float32), np.array([[1, 2, 4]]), (1, 2), 151655)
    with pytest.raises(grpc.RpcError) as err:
        engines.generate(QWEN3_ASR, generate_request("asr-image", ids, [item]))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "multimodal_not_supported" in (err.value.details() or "")


def test_the_vllm_wire_refuses_a_preprocessed_audio_batch() -> None:
    """smg-grpc-servicer 0.14.1 reads every non-video batch as image: audio features never reach a
    vLLM worker's model as audio, so the reference engine refuses the batch outright."""
    engine = start_engine(EngineConfig(model=require_bundle(QWEN3_ASR), port=0))
    try:
        mm = vllm_engine_pb2.MultimodalInputs(
            pixel_values=to_tensor_data(np.zeros((128, 100), np.float32)), modality=common_pb2.AUDIO,
            model_specific_tensors={"feature_attention_mask": to_tensor_data(np.ones((1, 100), np.int64))},
            mm_placeholders=[vllm_engine_pb2.PlaceholderRange(offset=1, length=13)])
        request = vllm_engine_pb2.GenerateRequest(
            request_id="vllm-audio", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[151669] + [151676] * 13),
            sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2), mm_inputs=mm)
        with pytest.raises(grpc.RpcError) as err:
            list(stub_for(engine.address).Generate(request, timeout=60))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "multimodal_not_supported" in (err.value.details() or "")
        assert "no preprocessed audio" in (err.value.details() or "")
    finally:
        engine.stop(grace=0)


def single_clip_request(name: str, request_id: str, reverse: bool = False) -> pb.GenerateRequest:
    """One clip (its frames reversed in time with ``reverse``), the first token's logprob asked for."""
    processor = processor_for(require_bundle(name))
    content = [{"type": "audio"}] + ([] if name == QWEN3_ASR else [{"type": "text", "text": "What is said?"}])
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    out = processor(text=[text], audio=[CLIPS[0]], return_tensors="pt")
    mask = out["feature_attention_mask" if "feature_attention_mask" in out else "input_features_mask"]
    valid = int(mask.sum())
    features = out["input_features"][0].numpy()[:, :valid]
    if reverse:
        features = features[:, ::-1]
    ids = [int(t) for t in out["input_ids"][0]]
    audio_token = processor.tokenizer.convert_tokens_to_ids(processor.audio_token)
    (run,) = runs(ids, audio_token)
    request = generate_request(request_id, ids, [audio_item(features, valid, run, audio_token, request_id)])
    request.return_logprob = True
    return request


@pytest.mark.parametrize("name", [QWEN2_5_OMNI, QWEN3_OMNI, QWEN3_ASR])
def test_the_output_depends_on_the_audio(engines: Engines, name: str) -> None:
    def answer(request: pb.GenerateRequest) -> tuple[list[int], list[float]]:
        responses = list(engines.stub(name).Generate(request, timeout=120))
        chunks = [r.chunk for r in responses if r.HasField("chunk") and r.chunk.token_ids]
        return [t for c in chunks for t in c.token_ids], [p for c in chunks for p in c.output_logprobs.token_logprobs]

    forward, backward = answer(single_clip_request(name, "fwd")), answer(single_clip_request(name, "bwd", True))
    assert len(forward[0]) == len(backward[0]) == STEPS and len(forward[1]) == STEPS
    assert forward != backward


@pytest.mark.parametrize("name", [QWEN2_5_OMNI, QWEN3_OMNI, QWEN3_ASR])
def test_audio_models_shrink_to_tiny_towers_keeping_ids_and_feature_geometry(name: str) -> None:
    from transformers import AutoConfig

    from mmgate.refengine.families import AUDIO_HIDDEN, AUDIO_LAYERS, TEXT_HIDDEN, engine_family
    from mmgate.refengine.shrink import shrink_config

    top = AutoConfig.from_pretrained(require_bundle(name))
    row = engine_family(str(top.model_type))
    config = getattr(top, row.sub_config) if row.sub_config else top
    shrunk = shrink_config(config, row.shrink)  # raises when a kept field changed
    audio, before = shrunk.audio_config, config.audio_config
    assert (audio.d_model, audio.encoder_layers, audio.output_dim) == (AUDIO_HIDDEN, AUDIO_LAYERS, TEXT_HIDDEN)
    assert (audio.num_mel_bins, audio.n_window) == (before.num_mel_bins, before.n_window) == (128, before.n_window)
    assert shrunk.audio_token_id == config.audio_token_id and shrunk.get_text_config().vocab_size == \
        config.get_text_config().vocab_size
    assert shrunk.get_text_config().hidden_size == TEXT_HIDDEN


def test_an_encode_worker_refuses_an_audio_item() -> None:
    """EPD carries images and video only here: the thinkers run their audio tower inside the forward."""
    from smg_grpc_proto.generated import tokenspeed_encoder_pb2, tokenspeed_encoder_pb2_grpc

    from mmgate.engines.base import Role

    engine = start_engine(EngineConfig(model=require_bundle(QWEN3_ASR), port=0, wire=Wire.TOKENSPEED,
                                       role=Role.ENCODE))
    try:
        clip = single_clip_request(QWEN3_ASR, "encode").mm_inputs.items[0]
        request = tokenspeed_encoder_pb2.EncodeRequest(
            request_id="encode", mm_inputs=pb.MultimodalInputs(items=[clip]),
            items=[tokenspeed_encoder_pb2.EncodeItemAssignment(bootstrap_room=7)])
        stub = tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderStub(grpc.insecure_channel(engine.address,
                                                                                       options=_OPTIONS))
        with pytest.raises(grpc.RpcError) as err:
            stub.Encode(request, timeout=60)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "encodes no audio" in (err.value.details() or "")
    finally:
        engine.stop(grace=0)


def _audio_inputs(features: np.ndarray, **side: np.ndarray) -> pb.MultimodalInputs:
    return pb.MultimodalInputs(items=[pb.MultimodalItem(
        modality=common_pb2.AUDIO, content_hash=b"x" * 32, encoder_input=tensor(features),
        model_specific_tensors={k: tensor(v) for k, v in side.items()},
        placeholders=[pb.PlaceholderRange(offset=1, length=3)])])


@pytest.mark.parametrize(("features", "side", "message"), [
    (np.zeros((2, 128, 40), np.float32), {}, "expected [num_mel_bins, frames] or [1, num_mel_bins, frames]"),
    (np.zeros((128, 40), np.float32), {"audio_feature_lengths": np.array([41])}, "outside [1, 40]"),
    (np.zeros((128, 40), np.float32), {"audio_feature_lengths": np.array([0])}, "outside [1, 40]"),
    (np.zeros((128, 40), np.float32), {"audio_feature_lengths": np.array([3, 4])}, "must hold one value"),
    (np.zeros((128, 40), np.float32), {"feature_attention_mask": np.ones((1, 39), np.int64)}, "expected [40]"),
    (np.zeros((128, 40), np.float32), {"feature_attention_mask": np.array([[0] * 5 + [1] * 35])},
     "right-padded contiguous ones"),
])
def test_malformed_audio_items_are_refused(features: np.ndarray, side: dict[str, np.ndarray], message: str) -> None:
    from mmgate.errors import ErrorCode, GatewayError
    from mmgate.refengine.tokenspeed_inputs import read_items

    with pytest.raises(GatewayError) as err:
        read_items(_audio_inputs(features, **side))
    assert err.value.code is ErrorCode.INVALID_REQUEST and message in err.value.message


def test_an_audio_item_without_side_tensors_takes_every_frame() -> None:
    from mmgate.refengine.tokenspeed_inputs import item_batches, read_items

    features = np.random.default_rng(0).standard_normal((1, 128, 40)).astype(np.float32)
    (batch,) = item_batches(read_items(_audio_inputs(features)))
    assert batch.primary == "input_features"
    assert batch.tensors["input_features"].numpy().tobytes() == features.tobytes()
    assert batch.tensors["feature_attention_mask"].tolist() == [[1] * 40]


@pytest.mark.parametrize("name", [QWEN2_5_OMNI, QWEN3_OMNI])
def test_an_omni_thinker_takes_an_image_on_the_vllm_wire(name: str) -> None:
    """Images (no audio) of an Omni model travel on the vLLM wire as Qwen-VL images do."""
    from tests.refengine.refengine_support import ImagePrompt, generate_request as vllm_request, image_mm_inputs

    processor = processor_for(require_bundle(name))
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    out = {k: v.numpy() for k, v in processor(text=[text], images=[random_image(64, 48)], return_tensors="pt").items()}
    prompt = ImagePrompt([int(t) for t in out["input_ids"][0]], out["pixel_values"], out["image_grid_thw"],
                         processor.tokenizer.convert_tokens_to_ids(processor.image_token))
    engine = start_engine(EngineConfig(model=require_bundle(name), port=0))
    try:
        (response,) = list(stub_for(engine.address).Generate(
            vllm_request(prompt.input_ids, image_mm_inputs(prompt), max_tokens=STEPS, ignore_eos=True), timeout=120))
    finally:
        engine.stop(grace=0)
    assert list(response.complete.output_ids) == transformers_greedy(name, out)

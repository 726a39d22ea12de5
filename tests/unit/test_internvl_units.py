"""InternVL3's small pieces, each against the reference or arithmetic written out here.

* the tokenizer adds the bundle's ``extra_special_tokens`` (``<video>`` 151674) as transformers does;
* the tile grid (``get_optimal_tiled_canvas``) and vLLM's frame indices on worked examples;
* the reference engine's frames-as-images rewrite: a clip's ``<video>`` ids (inside its range only)
  read as ``<IMG_CONTEXT>``, and image patches and clip frames joined in prompt order whichever batch
  comes first on the wire.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.models.bundle import load_bundle
from mmgate.models.internvl import optimal_tiled_canvas, supported_grids
from mmgate.models.frame_sampling import vllm_frame_indices
from mmgate.models.internvl_video import frame_text, reference_ids
from mmgate.refengine.frames_as_images import merge_batches, rewrite_ids
from mmgate.refengine.mm_inputs import MediaBatch
from mmgate.transport.inline import to_tensor_data
from mmgate.types import Modality
from tests.conftest import bundle_dir

MODEL = "OpenGVLab/InternVL3-1B-hf"
VIDEO, CONTEXT, START, END = 151674, 151667, 151665, 151666


def test_the_tokenizer_adds_extra_special_tokens_as_transformers_does() -> None:
    from transformers import AutoTokenizer

    path = bundle_dir(MODEL)
    mine = load_tokenizer(load_bundle(path))
    ref = AutoTokenizer.from_pretrained(path)
    assert mine.token_id("<video>") == ref.convert_tokens_to_ids("<video>") == VIDEO
    text = "a<video>b Frame1: <img><IMG_CONTEXT></img>\nFrame2:"
    assert mine.tokenizer.encode(text, add_special_tokens=False).ids == ref.encode(text, add_special_tokens=False)


def test_grid_worked_examples() -> None:
    tile = (448, 448)
    assert supported_grids(1, 4) == ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (1, 4), (2, 2), (4, 1))
    assert optimal_tiled_canvas(400, 900, tile, 1, 12) == (2, 1)  # ratio 2.25: (2, 1) beats (3, 1)
    # ratio 1: (1,1), (2,2), (3,3) tie; the later grid wins while the area exceeds half the grid's
    assert optimal_tiled_canvas(633, 633, tile, 1, 12) == (1, 1)  # 400689 <= 0.5 * 448^2 * 4 = 401408
    assert optimal_tiled_canvas(634, 634, tile, 1, 12) == (2, 2)
    assert optimal_tiled_canvas(951, 951, tile, 1, 12) == (3, 3)  # 904401 > 903168
    assert optimal_tiled_canvas(30, 1000, tile, 1, 12) == (12, 1)


def test_vllm_frame_indices_and_the_reference_ids() -> None:
    assert vllm_frame_indices(7) == list(range(7))
    assert vllm_frame_indices(32) == list(range(32))
    assert vllm_frame_indices(301) == [int(i) for i in np.linspace(0, 300, 32, dtype=int)]
    assert vllm_frame_indices(301)[:3] == [0, 9, 19] and vllm_frame_indices(301)[-1] == 300
    assert frame_text(2, "<img>", "<c>", "</img>", 2) == "Frame1: <img><c><c></img>\nFrame2: <img><c><c></img>"
    assert reference_ids([1, VIDEO, VIDEO, 2], VIDEO, CONTEXT) == [1, CONTEXT, CONTEXT, 2]


def _td(array: np.ndarray) -> vllm_engine_pb2.TensorData:
    return to_tensor_data(np.ascontiguousarray(array))


def test_frames_as_images_rewrites_the_clip_and_orders_rows_by_prompt_position() -> None:
    # prompt: an image (1 patch) at 1..4, then a clip of 2 frames (1 context id each) at 6..
    ids = [9, START, CONTEXT, END, 8, 7, START, VIDEO, END, 7, START, VIDEO, END, VIDEO]
    image = vllm_engine_pb2.MultimodalInputs(im_token_id=CONTEXT, modality=common_pb2.IMAGE)
    image.mm_placeholders.append(vllm_engine_pb2.PlaceholderRange(offset=1, length=3))
    image.flat_keys["pixel_values"] = "image_num_patches"
    video = vllm_engine_pb2.MultimodalInputs(im_token_id=VIDEO, modality=common_pb2.VIDEO)
    video.mm_placeholders.append(vllm_engine_pb2.PlaceholderRange(offset=5, length=8))
    video.flat_keys["pixel_values"] = "video_num_patches"
    request = vllm_engine_pb2.GenerateRequest(request_id="r")
    request.tokenized.input_ids.extend(ids)
    request.mm_inputs.CopyFrom(video)  # the clip's batch first on the wire, the image's after
    request.extra_mm_inputs.append(image)
    out = rewrite_ids(request, CONTEXT)
    # only <video> inside the clip's range (5..12) is rewritten; the one at 13 is outside every range
    assert list(out.tokenized.input_ids) == [CONTEXT if (t == VIDEO and 5 <= i < 13) else t for i, t in enumerate(ids)]
    assert list(request.tokenized.input_ids) == ids  # a copy
    frames = torch.stack([torch.full((3, 2, 2), 1.0), torch.full((3, 2, 2), 2.0)])
    patch = torch.full((1, 3, 2, 2), 0.0)
    batches = [MediaBatch(Modality.VIDEO, {"pixel_values_videos": frames,
                                           "video_num_patches": torch.tensor([2])}, "pixel_values_videos"),
               MediaBatch(Modality.IMAGE, {"pixel_values": patch, "image_num_patches": torch.tensor([1])},
                          "pixel_values")]
    (merged,) = merge_batches(request, batches)
    assert merged.modality is Modality.IMAGE and merged.primary == "pixel_values"
    assert merged.tensors["pixel_values"][:, 0, 0, 0].tolist() == [0.0, 1.0, 2.0]  # image (offset 1), then frames


def test_a_request_without_a_clip_is_left_as_it_is() -> None:
    request = vllm_engine_pb2.GenerateRequest(request_id="r")
    request.tokenized.input_ids.extend([1, 2])
    batch = MediaBatch(Modality.IMAGE, {"pixel_values": torch.zeros(1, 3, 2, 2)}, "pixel_values")
    assert rewrite_ids(request, CONTEXT) is request
    assert merge_batches(request, [batch]) == [batch]


@pytest.mark.parametrize("frames", [1, 2])
def test_the_clip_text_holds_256_context_tokens_per_frame(frames: int) -> None:
    from mmgate.models.registry import load_family
    from mmgate.models.backend import ImageBackend

    bundle = load_bundle(bundle_dir(MODEL))
    tok = load_tokenizer(bundle)
    family = load_family(bundle, tok, ImageBackend.PIL)
    assert family is not None and family.video is not None
    text = frame_text(frames, "<img>", "<video>", "</img>", 256)
    ids = tok.tokenizer.encode("\n" + text, add_special_tokens=False).ids[1:]
    assert ids.count(VIDEO) == 256 * frames and ids[:5] == [4369, 16, 25, 220, START]  # "Frame", "1", ":", " "


@pytest.mark.parametrize(("hints", "param"), [
    ({"fps": 2.0}, "messages[0].content[0].fps"),
    ({"max_long_side_pixel": 448}, "messages[0].content[0].max_long_side_pixel"),
    ({"options": (("max_patches", 6),)}, "mm_processor_kwargs"),
])
def test_a_clip_takes_no_hint(hints: dict, param: str) -> None:
    """vLLM samples an InternVL clip's frames and sizes them itself; a hint would be ignored, so it is refused
    (and never splits the fetch or cache key of one clip)."""
    from mmgate.errors import ErrorCode, GatewayError
    from mmgate.models.backend import ImageBackend
    from mmgate.models.registry import load_family
    from mmgate.types import ItemHints

    bundle = load_bundle(bundle_dir(MODEL))
    family = load_family(bundle, load_tokenizer(bundle), ImageBackend.PIL)
    assert family is not None and family.video is not None
    with pytest.raises(GatewayError) as err:
        family.video.check_hints(ItemHints(**hints), "messages[0].content[0]")
    assert err.value.code is ErrorCode.INVALID_REQUEST and err.value.param == param

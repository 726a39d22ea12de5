"""The golden corpora of ``scripts/gen_golden.py``: the images, option sets and conversations each
fixture records (the replay reads them back from the fixture, not from here).

Images are :class:`parity_support.ImageSpec` rows (width, height, mode, seed, format, name): the
bytes are regenerated from them.  Conversations are ``(role, parts)`` turns, an int part an index
into the conversation's ``images``; the comment after a row says what it exercises.
"""

from __future__ import annotations

from gemma3_support import PAS_CUSTOM, PAS_ON
from parity_support import ImageSpec

#: Qwen-VL: name, width, height, mode, seed, format — one row each per bundle and backend
QWEN_VL_IMAGES: tuple[ImageSpec, ...] = (
    ImageSpec(640, 480, "RGB", 1, "PNG", "rgb_640x480"),  # resize to 644x476 (28) / 640x480 (32): mixed direction
    ImageSpec(1, 1, "RGB", 2, "PNG", "tiny_1x1"),  # upscaled to min_pixels
    ImageSpec(1, 37, "L", 3, "PNG", "gray_1x37"),
    ImageSpec(200, 1, "RGB", 4, "PNG", "aspect_200_200x1"),  # aspect ratio exactly 200: accepted
    ImageSpec(201, 1, "RGB", 5, "PNG", "aspect_201_201x1"),  # aspect ratio 201: refused
    ImageSpec(27, 29, "RGBA", 6, "PNG", "rgba_27x29"),  # factor 28 -1 / +1
    ImageSpec(33, 31, "P", 7, "PNG", "palette_33x31"),  # factor 32 +1 / -1
    ImageSpec(57, 85, "P+tRNS", 8, "PNG", "palette_trns_57x85"),  # one transparent palette index
    ImageSpec(64, 48, "P+alpha", 9, "PNG", "palette_alpha_64x48"),  # per-index alpha table
    ImageSpec(113, 250, "LA", 10, "PNG", "gray_alpha_113x250"),
    ImageSpec(42, 70, "RGB", 11, "PNG", "round_half_42x70"),  # 42/28 = 1.5 -> 2, 70/28 = 2.5 -> 2
    ImageSpec(448, 448, "RGB", 12, "PNG", "exact_grid_448x448"),  # multiple of 28 and 32
    ImageSpec(1023, 769, "RGB", 13, "JPEG", "jpeg_1023x769"),
    ImageSpec(45, 300, "L", 14, "JPEG", "jpeg_gray_45x300"),
)

#: conversations: (role, parts) turns; an int part is an index into ``images``
QWEN_VL_CONVERSATIONS: tuple[dict, ...] = (
    {"images": ["rgb_640x480"], "turns": [["user", [0, "What is in this image?"]]]},
    {"images": ["tiny_1x1", "palette_trns_57x85"],
     "turns": [["user", [0, "Describe it."]], ["assistant", ["A dot."]], ["user", [1, "And this one? é 日本語 🙂"]]]},
    {"images": ["jpeg_1023x769", "round_half_42x70", "gray_alpha_113x250"],
     "turns": [["system", ["You are terse."]], ["user", ["Compare ", 0, ", ", 1, " and\n\n", 2, "."]]]},
)

#: LLaVA-1.5 and LLaVA-NeXT (one corpus, one fixture per bundle)
LLAVA_IMAGES: tuple[ImageSpec, ...] = (
    ImageSpec(640, 480, "RGB", 1, "PNG", "rgb_640x480"),  # NeXT: pinpoint 672x672, 2x2 tiles, padded top/bottom
    ImageSpec(1, 1, "RGB", 2, "PNG", "tiny_1x1"),  # 336x336 upscale; NeXT: pinpoint 336x672 (tie, first wins)
    ImageSpec(1, 37, "L", 3, "PNG", "gray_1x37"),  # thin strip, grey
    ImageSpec(300, 1, "RGB", 4, "PNG", "strip_300x1"),  # LLaVA-1.5: resized to 100800x336 before the crop
    ImageSpec(2, 500, "RGB", 5, "PNG", "strip_2x500"),  # NeXT: pinpoint 1008x336
    ImageSpec(27, 29, "RGBA", 6, "PNG", "rgba_27x29"),
    ImageSpec(33, 31, "P", 7, "PNG", "palette_33x31"),
    ImageSpec(57, 85, "P+tRNS", 8, "PNG", "palette_trns_57x85"),
    ImageSpec(64, 48, "P+alpha", 9, "PNG", "palette_alpha_64x48"),
    ImageSpec(113, 250, "LA", 10, "PNG", "gray_alpha_113x250"),
    ImageSpec(336, 336, "RGB", 11, "PNG", "exact_336x336"),  # no resize (LLaVA-1.5), base tile unchanged (NeXT)
    ImageSpec(672, 336, "RGB", 12, "PNG", "pinpoint_672x336"),  # NeXT: exactly the 336x672 pinpoint, no padding
    ImageSpec(673, 336, "RGB", 13, "PNG", "pinpoint_673x336"),  # one pixel past it
    ImageSpec(1009, 335, "RGB", 14, "PNG", "around_1008x336"),  # NeXT: near the 336x1008 pinpoint
    ImageSpec(1023, 769, "RGB", 15, "JPEG", "jpeg_1023x769"),
    ImageSpec(45, 300, "L", 16, "JPEG", "jpeg_gray_45x300"),
)

#: every turn is a part list (the LLaVA-NeXT template reads ``message['content'][0]['text']``)
LLAVA_CONVERSATIONS: tuple[dict, ...] = (
    {"images": ["rgb_640x480"], "turns": [["user", [0, "What is in this image?"]]]},
    {"images": ["tiny_1x1", "palette_trns_57x85"],
     "turns": [["user", ["Describe ", 0, " briefly."]], ["assistant", ["A dot."]],
               ["user", [1, "And this one? é 日本語 🙂"]]]},
    {"images": ["jpeg_1023x769", "strip_2x500", "gray_alpha_113x250"],
     "turns": [["user", ["Compare ", 0, ", ", 1, " and\n\n", 2, "."]]]},
)

#: Gemma 3; comments give the pan-and-scan outcome with the defaults (256 / 4 / 1.2)
GEMMA3_IMAGES: tuple[ImageSpec, ...] = (
    ImageSpec(640, 480, "RGB", 1, "PNG", "rgb_640x480"),  # ratio 1.33 -> 2 crops of 480x320
    ImageSpec(1500, 480, "RGBA", 2, "PNG", "rgba_wide_1500x480"),  # ratio 3.1 -> 3 crops of 480x500
    ImageSpec(1, 1, "L", 3, "PNG", "tiny_1x1"),  # no crops (crop side < 256)
    ImageSpec(300, 1200, "P", 4, "PNG", "palette_tall_300x1200"),  # ratio 4 -> 4 crops of 300x300
    ImageSpec(896, 896, "RGB", 5, "PNG", "exact_896x896"),  # no resize at all
    ImageSpec(1792, 896, "RGB", 6, "PNG", "crops_exact_1792x896"),  # 2 crops of exactly 896x896
    ImageSpec(1001, 300, "LA", 7, "PNG", "uneven_1001x300"),  # 3 crops, the last one 333 wide
    ImageSpec(600, 500, "RGB", 8, "PNG", "ratio_1.2_600x500"),  # ratio exactly 1.2: activates, 2 crops
    ImageSpec(599, 500, "RGB", 9, "PNG", "ratio_below_599x500"),  # ratio 1.198: no crops
    ImageSpec(510, 400, "P+tRNS", 10, "PNG", "crop_255_510x400"),  # 2 crops of 255 < 256: none
    ImageSpec(511, 400, "P+alpha", 11, "PNG", "crop_256_511x400"),  # 2 crops of 256 (last 255)
    ImageSpec(2000, 3, "RGB", 12, "PNG", "strip_2000x3"),  # thin strip: crop height 3 < 256, none
    ImageSpec(1023, 769, "RGB", 13, "JPEG", "jpeg_1023x769"),  # ratio 1.33 -> 2 crops
    ImageSpec(45, 300, "L", 14, "JPEG", "jpeg_gray_45x300"),  # crop width 45 < 256: none
)

#: ``mm_processor_kwargs`` per row: off (the bundle's default), on, and custom values on a few images
GEMMA3_OPTION_SETS: tuple[tuple[dict, tuple[str, ...] | None], ...] = (
    ({}, None),
    (PAS_ON, None),
    (PAS_CUSTOM, ("rgb_640x480", "uneven_1001x300", "jpeg_gray_45x300", "exact_896x896")),
)

#: ``options``: the conversation's mm_processor_kwargs
GEMMA3_CONVERSATIONS: tuple[dict, ...] = (
    {"images": ["rgb_640x480"], "options": {}, "turns": [["user", ["look:\n", 0, "\nnow"]]]},
    {"images": ["rgb_640x480", "tiny_1x1"], "options": {},
     "turns": [["system", ["You are terse."]], ["user", [0, 1, "Compare."]]]},  # "\n\n\n\n" tokens
    {"images": ["jpeg_gray_45x300"], "options": {},
     "turns": [["system", ["Rules:\n"]], ["user", [0, "What is it?"]]]},  # five newlines: one token
    {"images": ["rgba_wide_1500x480", "palette_tall_300x1200", "tiny_1x1"], "options": PAS_ON,
     "turns": [["user", ["A", 0, "B", 1, "C", 2]]]},
    {"images": ["uneven_1001x300", "crop_256_511x400"], "options": PAS_CUSTOM,
     "turns": [["user", [0, "Describe it."]], ["assistant", ["A gradient."]],
               ["user", ["And this one? é 日本語 🙂\n\n", 1]]]},
)

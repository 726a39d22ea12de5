"""Video decode + sample + preprocess: mmgate against the transformers video path, as ratios.

Clips (generated into ``--clips-dir`` with PyAV's libx264 unless already there):
* ``10s_30fps_640x360``: 300 frames;
* ``10s_30fps_1280x720``: 300 frames (the clip of ``benchmarks/e2e_video.py``);
* ``60s_30fps_1080p``: 1800 frames of 1920x1080 at a low bitrate.

Per clip and model, one process measures, interleaved, on the same bytes:
* ``mmgate``: ``decode_video`` (frames sampled from the header, only the kept
  frames converted to RGB, FFmpeg frame threads) + the video processor's ``plan``,
  ``preprocess`` and ``expand`` + ``assemble`` (the gateway's calls);
* ``mmgate/slice``: the same with PyAV's default decoder threading (what the
  reference loader gets), to separate the threading gain from the rest;
* ``hf``: what the transformers video processor does with a path, with its pyav
  loader: ``load_video(path, backend="pyav", sample_indices_fn=video_processor.sample_frames
  with the call's kwargs)`` then ``video_processor(frames, video_metadata=...,
  do_sample_frames=False)`` (its own path picks torchcodec, not installed here).

Models: Qwen3-VL (its default: 2 fps) and Qwen2.5-VL with ``video_url.fps=2``
(``do_sample_frames=True, fps=2``; its default keeps every frame).  Before
timing, mmgate's ``pixel_values`` and grid are checked equal to ``hf``'s
(max |diff| printed, 0 expected).  Each round runs every contender once per
cell in a rotated order; the reported ratio is the median over rounds of
``hf seconds / mmgate seconds`` (> 1: mmgate faster).

Run:  python benchmarks/video.py [--rounds 3] [--json bench-out/video.json] [--clips-dir bench-out/clips]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from bench_report import (
    MODELS_DIR,
    REPO_ROOT,
    environment,
    median,
    render_table,
    write_json,
)

import mmgate.media.video as video_module
from mmgate.chat.tokenizer import load_tokenizer
from mmgate.media.video import decode_video
from mmgate.models.bundle import load_bundle
from mmgate.models.family import assemble
from mmgate.models.registry import load_family
from mmgate.models.backend import ImageBackend
from mmgate.types import ItemHints

#: name -> (seconds, fps, width, height, x264 options)
CLIPS = {
    "10s_30fps_640x360": (10, 30, 640, 360, {"preset": "veryfast", "crf": "23"}),
    "10s_30fps_1280x720": (10, 30, 1280, 720, {"preset": "veryfast", "crf": "23"}),  # the e2e video cell's
    "60s_30fps_1080p": (60, 30, 1920, 1080, {"preset": "ultrafast", "b": "1500k", "maxrate": "1500k",
                                               "bufsize": "3000k"}),
}
#: bundle folder -> (label, hints, reference video-processor kwargs)
MODELS = {
    "Qwen--Qwen3-VL-2B-Instruct": ("qwen3_vl", ItemHints(), {}),
    "Qwen--Qwen2.5-VL-7B-Instruct": ("qwen2_5_vl fps=2", ItemHints(fps=2.0), {"do_sample_frames": True, "fps": 2.0}),
}
CONTENDERS = ("mmgate", "mmgate/slice", "hf")


def make_clip(path: Path, seconds: int, fps: int, width: int, height: int, options: dict[str, str]) -> None:
    """A moving, textured clip: a fixed random texture scrolled a few pixels per frame plus a moving bar."""
    import av

    rng = np.random.default_rng(0)
    texture = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    texture = np.repeat(np.repeat(texture, 8, axis=0), 8, axis=1)[:height, :width]
    yy, xx = np.mgrid[0:height, 0:width]
    gradient = ((xx * 255 // max(width - 1, 1) + yy * 255 // max(height - 1, 1)) // 2).astype(np.uint8)
    container = av.open(str(path), "w")
    stream = container.add_stream("libx264", rate=fps, options=options)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    stream.codec_context.time_base = Fraction(1, fps)
    for i in range(seconds * fps):
        frame = np.roll(texture, (i * 3, i * 5), axis=(0, 1)).copy()
        frame[..., 2] = gradient
        bar = (i * 17) % width
        frame[:, bar:bar + width // 40] = 255
        for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()


@dataclass
class Cell:
    clip: str
    model: str
    fns: dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]]
    seconds: dict[str, list[float]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def mmgate_fn(family: Any, data: bytes, hints: ItemHints, thread_type: str) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    def run() -> tuple[np.ndarray, np.ndarray]:
        video_module.DECODE_THREAD_TYPE = thread_type
        try:
            clip = decode_video(data, lambda meta: family.video.sample(meta, hints), None, 600.0)
        finally:
            video_module.DECODE_THREAD_TYPE = "AUTO"
        plan = family.video.plan(clip, hints)
        batch = assemble(family.video, [plan], [family.video.preprocess(clip, plan)])
        family.video.expand(plan)
        return batch.tensors["pixel_values"], batch.tensors["video_grid_thw"]

    return run


def hf_fn(processor: Any, path: Path, kwargs: dict[str, Any]) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    from transformers.video_utils import load_video

    vp = processor.video_processor
    sample_kwargs = {k: v for k, v in kwargs.items() if k != "do_sample_frames"}

    def run() -> tuple[np.ndarray, np.ndarray]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            frames, meta = load_video(str(path), backend="pyav",
                                      sample_indices_fn=lambda metadata, **_: vp.sample_frames(metadata, **sample_kwargs))
            out = vp(videos=[frames], video_metadata=[meta], do_sample_frames=False, return_tensors="np",
                     cap_pixels_per_frame=False)
        return out["pixel_values_videos"], out["video_grid_thw"]

    return run


def build_cells(clips_dir: Path, clips: list[str], models: list[str]) -> list[Cell]:
    from transformers import AutoProcessor

    clips_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in clips:
        path = clips_dir / f"{name}.mp4"
        if not path.is_file():
            t0 = time.perf_counter()
            make_clip(path, *CLIPS[name])
            print(f"generated {path} ({path.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.0f}s")
        paths[name] = path
    cells = []
    for folder in models:
        label, hints, kwargs = MODELS[folder]
        bundle = load_bundle(MODELS_DIR / folder)
        family = load_family(bundle, load_tokenizer(bundle), ImageBackend.TORCHVISION)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            processor = AutoProcessor.from_pretrained(str(MODELS_DIR / folder))
        for name in clips:
            data = paths[name].read_bytes()
            fns = {"mmgate": mmgate_fn(family, data, hints, "AUTO"),
                   "mmgate/slice": mmgate_fn(family, data, hints, "SLICE"),
                   "hf": hf_fn(processor, paths[name], kwargs)}
            cells.append(Cell(name, label, fns, {c: [] for c in CONTENDERS}))
    return cells


def check_parity(cell: Cell) -> str:
    (ours, grid), (ref, ref_grid) = cell.fns["mmgate"](), cell.fns["hf"]()
    if ours.shape != ref.shape or not np.array_equal(grid, ref_grid):
        return f"{cell.clip} {cell.model}: MISMATCH {ours.shape} {grid.tolist()} vs {ref.shape} {ref_grid.tolist()}"
    diff = float(np.max(np.abs(ours - ref))) if ours.size else 0.0
    cell.info.update(grid=grid.tolist()[0], pixel_values_shape=list(ours.shape), max_abs_diff=diff)
    return f"{cell.clip} {cell.model}: video_grid_thw {grid.tolist()[0]} pixel_values {ours.shape} max|diff| {diff:g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clips", nargs="*", default=list(CLIPS), choices=list(CLIPS))
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--clips-dir", type=Path, default=REPO_ROOT / "bench-out" / "clips")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)

    import torch

    env = environment() | {"torch_threads": torch.get_num_threads()}
    print(f"# video benchmark  {env['date_utc']}  cpus={env['cpus']} load={env['loadavg_at_start']} "
          f"torch_threads={env['torch_threads']}")
    cells = build_cells(args.clips_dir, args.clips, args.models)
    for cell in cells:
        print(check_parity(cell))
    for r in range(args.rounds):
        for cell in cells:
            order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]
            for name in order:
                t0 = time.perf_counter()
                cell.fns[name]()
                cell.seconds[name].append(time.perf_counter() - t0)
    rows, results = [], []
    for cell in cells:
        s = {c: median(cell.seconds[c]) for c in CONTENDERS}
        ratio = median([h / m for h, m in zip(cell.seconds["hf"], cell.seconds["mmgate"])])
        ratio_slice = median([h / m for h, m in zip(cell.seconds["hf"], cell.seconds["mmgate/slice"])])
        rows.append([cell.clip, cell.model, str(cell.info.get("grid")), s["mmgate"], s["mmgate/slice"], s["hf"],
                     ratio, ratio_slice])
        results.append({"clip": cell.clip, "model": cell.model, **cell.info, "seconds": cell.seconds,
                        "median_s": s, "hf_over_mmgate": ratio, "hf_over_mmgate_slice": ratio_slice})
    print(render_table(["clip", "model", "grid_thw", "mmgate s", "mmgate/slice s", "hf s", "hf/mmgate",
                        "hf/mmgate-slice"], rows))
    write_json(args.json, {"environment": env, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

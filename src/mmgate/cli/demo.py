"""The quick start: one image chat request through mmgate to the reference engine.

Starts ``mmgate engine`` and ``mmgate serve`` on loopback with a bundled
Qwen-VL model (default ``Qwen/Qwen2-VL-2B-Instruct`` from the model search
path; random weights unless the bundle folder holds real ones), sends a chat
request with a generated sample image as a ``data:`` URL, prints the answer,
the prompt token count and the stage timings, then stops both.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from PIL import Image, ImageDraw

from mmgate.cli.launch import start_engine, start_gateway
from mmgate.config.settings import ENV_MODEL_PATH, split_search_path


def default_search_path() -> list[Path]:
    """``$MMGATE_MODEL_PATH``, else ``<checkout>/../shared/models`` (where the bundles live beside a checkout)."""
    env = split_search_path(os.environ.get(ENV_MODEL_PATH))
    if env:
        return list(env)
    return [Path(__file__).resolve().parents[4] / "shared" / "models"]


def sample_image_data_url(width: int = 640, height: int = 480) -> str:
    """A deterministic JPEG (sky, sun, house) as a ``data:`` URL."""
    img = Image.new("RGB", (width, height), (120, 170, 235))
    draw = ImageDraw.Draw(img)
    draw.rectangle((0, height * 2 // 3, width, height), fill=(70, 150, 60))
    draw.ellipse((width - 160, 40, width - 60, 140), fill=(250, 220, 60))
    draw.rectangle((180, 200, 380, 340), fill=(180, 60, 50))
    draw.polygon([(160, 200), (280, 110), (400, 200)], fill=(110, 40, 30))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmgate demo", description=__doc__)
    p.add_argument("--model", default="Qwen/Qwen2-VL-2B-Instruct")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt", default="Describe this image in one sentence.")
    args = p.parse_args(list(argv or []))
    search = default_search_path()
    env = dict(os.environ)
    env[ENV_MODEL_PATH] = os.pathsep.join(str(s) for s in search)
    env.setdefault("HF_HUB_OFFLINE", "1")
    model = args.model
    for root in search:
        if (root / model.replace("/", "--") / "config.json").is_file():
            model = str(root / model.replace("/", "--"))
            break
    with tempfile.TemporaryDirectory(prefix="mmgate-demo-") as logs:
        print(f"[demo] model bundle: {model}")
        t0 = time.perf_counter()
        engine = start_engine(model, log_dir=Path(logs), env=env)
        print(f"[demo] reference engine on 127.0.0.1:{engine.port} ({time.perf_counter() - t0:.1f}s)")
        gateway = None
        try:
            gateway = start_gateway(model, [engine.port], log_dir=Path(logs), env=env)
            print(f"[demo] gateway on 127.0.0.1:{gateway.port}")
            body = {
                "model": args.model,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": sample_image_data_url()}},
                    {"type": "text", "text": args.prompt}]}],
                "max_tokens": args.max_tokens, "temperature": 0,
            }
            r = httpx.post(f"http://127.0.0.1:{gateway.port}/v1/chat/completions", json=body, timeout=300)
            if r.status_code != 200:
                print(f"[demo] request failed: {r.status_code} {r.text}", file=sys.stderr)
                return 1
            out = r.json()
            print("[demo] answer:", repr(out["choices"][0]["message"]["content"]))
            print("[demo] finish_reason:", out["choices"][0]["finish_reason"])
            print("[demo] usage:", out["usage"])
            print("[demo] stage timings (ms):", r.headers.get("X-Mmgate-Stage-Ms", ""))
            return 0
        finally:
            if gateway is not None:
                gateway.stop()
            engine.stop()

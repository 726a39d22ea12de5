"""The README's first command runs the main job: ``mmgate demo`` (what scripts/quickstart.sh runs after installing)."""

from __future__ import annotations

import ast
import base64
import io
import os
import subprocess
import sys

from PIL import Image

from mmgate.cli.demo import sample_image_data_url
from tests.conftest import bundle_dir


def _reference_prompt_tokens(prompt: str) -> int:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(bundle_dir("Qwen/Qwen2-VL-2B-Instruct"))
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    image = Image.open(io.BytesIO(base64.b64decode(sample_image_data_url().split(",", 1)[1])))
    return int(processor(text=[text], images=[image], return_tensors="np")["input_ids"].shape[1])


def test_demo_prints_a_completion_the_prompt_tokens_and_the_stage_timings() -> None:
    result = subprocess.run([sys.executable, "-m", "mmgate.cli", "demo", "--max-tokens", "4"], capture_output=True,
                            text=True, timeout=600, env=dict(os.environ))
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "[demo] answer:" in out
    usage_line = next(line for line in out.splitlines() if line.startswith("[demo] usage:"))
    usage = ast.literal_eval(usage_line.split(":", 1)[1].strip())
    assert usage["prompt_tokens"] == _reference_prompt_tokens("Describe this image in one sentence.")
    assert 1 <= usage["completion_tokens"] <= 4
    assert "preprocess=" in out and "engine_first_response=" in out

"""Configuration: one option definition for serve, engine and sidecar; environment fallbacks;
deprecation warnings; unreadable values; grouped --help; docs/configuration.md kept in step.

Precedence and variable names follow the Rust gateway's multimodal configuration summary
(lightseekorg/smg docs/reference/configuration.md, "Multimodal Configuration", v1.11): flag,
then ``SMG_*`` variable, then default; the legacy ``SMG_TOKENSPEED_MM_*`` spellings and the
env-only-turned-flag variables (``SMG_MM_PROCESSING``, ``SMG_MM_PIXEL_CACHE_MB``,
``SMG_LOG_MM_TIMING``) are deprecated there and here.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mmgate.config.docs import DOC_PATH, render
from mmgate.config.options import groups, option_record
from mmgate.refengine.config import build_arg_parser, parse_args
from mmgate.config.settings import Settings, build_parser, parse_settings
from mmgate.sidecar.config import processing_config
from mmgate.sidecar.server import build_parser as sidecar_parser

SHARED_GROUPS = ("media intake", "video")
GATEWAY_ONLY = {"SMG_MM_SHM_MIN_BYTES", "SMG_MM_TENSOR_TRANSPORT", "SMG_MM_PROCESSING", "SMG_MM_PIXEL_CACHE_MB"}


def serve(env: dict[str, str], *flags: str) -> Settings:
    return parse_settings(["--model", "m", *flags], env)


def test_the_committed_configuration_page_is_the_rendered_definitions() -> None:
    assert DOC_PATH == Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert DOC_PATH.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md drifted from the option definitions: "
        "python -m mmgate.config.docs > docs/configuration.md")


def test_the_page_lists_every_flag_of_the_three_commands_under_its_command() -> None:
    page = DOC_PATH.read_text(encoding="utf-8")
    sections = page.split("\n## `")
    assert [s.split("`", 1)[0] for s in sections[1:]] == ["mmgate serve", "mmgate engine", "mmgate sidecar"]
    for section, parser in zip(sections[1:], (build_parser(), build_arg_parser(), sidecar_parser()), strict=True):
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in section, flag


def _describe(action: argparse.Action) -> tuple[object, ...]:
    record = option_record(action)
    assert record is not None, action.option_strings
    return (tuple(action.option_strings), action.nargs, action.type, action.choices, record.default,
            record.env, record.deprecated, record.env_doc, record.minimum, record.help)


def test_serve_engine_and_sidecar_share_the_media_and_video_groups() -> None:
    described = []
    for parser in (build_parser(), build_arg_parser(), sidecar_parser()):
        by_title = dict(groups(parser))
        described.append({t: [_describe(a) for a in by_title[t]] for t in SHARED_GROUPS})
    assert described[0] == described[1] == described[2]
    flags = {f for a in build_parser()._actions for f in a.option_strings
             if (r := option_record(a)) is not None and r.group in SHARED_GROUPS}
    assert {"--mm-allowed-media-domains", "--mm-allow-private-media-hosts", "--mm-fetch-timeout",
            "--mm-fetch-connect-timeout", "--mm-fetch-read-timeout", "--mm-max-redirects",
            "--image-max-input-bytes", "--video-max-input-bytes", "--audio-max-input-bytes",
            "--mm-image-max-pixels", "--image-backend", "--mm-limit", "--video-max-decoded-pixels",
            "--video-decode-timeout", "--video-apply-rotation"} <= flags


def test_one_environment_configures_the_gateway_the_engine_and_the_sidecar_alike() -> None:
    env = {"SMG_IMAGE_MAX_INPUT_BYTES": "1234", "MMGATE_ALLOW_PRIVATE_MEDIA_HOSTS": "yes",
           "MMGATE_IMAGE_BACKEND": "PIL", "SMG_VIDEO_PROCESS_TIMEOUT_SECS": "7.5", "SMG_IMAGE_MAX_COUNT": "3",
           "MMGATE_VIDEO_APPLY_ROTATION": "off"}
    gateway = serve(env)
    engine = parse_args(["--model", "/m"], env).mm.processing
    parser = sidecar_parser()
    sidecar = processing_config(parser.parse_args(["--model", "m"]), parser, env)
    for worker in (engine, sidecar):
        assert worker.fetch == gateway.fetch and worker.video == gateway.video
        assert worker.image_backend == gateway.image_backend and dict(worker.item_limits) == gateway.item_limits
    assert gateway.fetch.image_max_bytes == 1234 and gateway.fetch.allow_private_hosts is True
    assert gateway.image_backend.value == "pil" and gateway.item_limits == {"image": 3}
    assert gateway.video.decode_timeout_s == 7.5 and gateway.video.apply_rotation is False


@pytest.mark.parametrize("flag,value,var,env_value,read,expected", [
    # expected: (default, from the variable, from the flag)
    ("--multimodal-shm-min-bytes", "10", "SMG_MM_SHM_MIN_BYTES", "4096", lambda s: s.transport.shm_min_bytes,
     (65536, 4096, 10)),
    ("--multimodal-shm-min-bytes", "10", "SMG_TOKENSPEED_MM_SHM_MIN_BYTES", "4096",
     lambda s: s.transport.shm_min_bytes, (65536, 4096, 10)),
    ("--multimodal-tensor-transport", "inline", "SMG_MM_TENSOR_TRANSPORT", "SHM",
     lambda s: s.transport.tensor_transport.value, ("inline", "shm", "inline")),
    ("--multimodal-encoder-dtype", "float16", "SMG_VLLM_ENCODER_INPUT_DTYPE", "bfloat16",
     lambda s: s.transport.encoder_dtype, ("auto", "bfloat16", "float16")),
    ("--multimodal-encoder-dtype", "float16", "MMGATE_MM_ENCODER_DTYPE", "float32",
     lambda s: s.transport.encoder_dtype, ("auto", "float32", "float16")),
    ("--mm-pixel-cache-mb", "1", "SMG_MM_PIXEL_CACHE_MB", "2", lambda s: s.transport.pixel_cache_bytes,
     (0, 2 * 1024 * 1024, 1024 * 1024)),
    ("--video-decode-timeout", "3", "SMG_VIDEO_PROCESS_TIMEOUT_SECS", "9", lambda s: s.video.decode_timeout_s,
     (30.0, 9.0, 3.0)),
    ("--audio-max-input-bytes", "5", "SMG_AUDIO_MAX_INPUT_BYTES", "6", lambda s: s.fetch.audio_max_bytes,
     (64 * 1024 * 1024, 6, 5)),
    ("--model-path", "/a", "MMGATE_MODEL_PATH", "/b", lambda s: s.model_search_path, ((), (Path("/b"),), (Path("/a"),))),
])
def test_the_flag_beats_the_variable_which_beats_the_default(flag: str, value: str, var: str, env_value: str,
                                                             read: Callable[[Settings], object],
                                                             expected: tuple[object, object, object]) -> None:
    assert (read(serve({})), read(serve({var: env_value})), read(serve({var: env_value}, flag, value))) == expected


def test_item_limit_flags_beat_the_count_variables() -> None:
    env = {"SMG_IMAGE_MAX_COUNT": "5", "SMG_VIDEO_MAX_COUNT": "1"}
    assert serve(env).item_limits == {"image": 5, "video": 1}
    assert serve(env, "--mm-per-request-image-limit", "2").item_limits == {"image": 2, "video": 1}
    assert serve(env, "--mm-per-request-image-limit", "2", "--mm-limit", "image=4").item_limits == {
        "image": 4, "video": 1}


def test_the_current_variable_beats_its_legacy_spelling_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mmgate.settings"):
        settings = serve({"SMG_MM_TENSOR_TRANSPORT": "auto", "SMG_TOKENSPEED_MM_TENSOR_TRANSPORT": "shm"})
    assert settings.transport.tensor_transport.value == "auto"
    assert caplog.records == []


def test_each_deprecated_variable_warns_once_and_current_ones_do_not(caplog: pytest.LogCaptureFixture) -> None:
    env = {"SMG_MM_PROCESSING": "router", "SMG_MM_PIXEL_CACHE_MB": "1", "SMG_TOKENSPEED_MM_SHM_MIN_BYTES": "0",
           "SMG_LOG_MM_TIMING": "1", "SMG_IMAGE_MAX_INPUT_BYTES": "100", "SMG_MM_TENSOR_TRANSPORT": "shm"}
    with caplog.at_level(logging.WARNING, logger="mmgate.settings"):
        settings = serve(env)
    assert (settings.mm_processing.value, settings.transport.pixel_cache_bytes, settings.transport.shm_min_bytes,
            settings.log_mm_timing, settings.fetch.image_max_bytes) == ("router", 1 << 20, 0, True, 100)
    messages = [r.getMessage() for r in caplog.records]
    assert sorted(m.split(" ", 1)[0] for m in messages) == [
        "SMG_LOG_MM_TIMING", "SMG_MM_PIXEL_CACHE_MB", "SMG_MM_PROCESSING", "SMG_TOKENSPEED_MM_SHM_MIN_BYTES"]
    assert all("deprecated" in m for m in messages)
    assert any("--mm-processing" in m for m in messages if m.startswith("SMG_MM_PROCESSING"))


def test_a_flag_given_leaves_its_deprecated_variable_unread(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mmgate.settings"):
        assert serve({"SMG_MM_PROCESSING": "router"}, "--mm-processing", "worker").mm_processing.value == "worker"
    assert caplog.records == []


@pytest.mark.parametrize("var,value", [
    ("SMG_IMAGE_MAX_INPUT_BYTES", "lots"),
    ("SMG_VIDEO_MAX_INPUT_BYTES", "0"),
    ("SMG_MM_SHM_MIN_BYTES", "-1"),
    ("SMG_MM_TENSOR_TRANSPORT", "carrier-pigeon"),
    ("SMG_MM_PROCESSING", "sometimes"),
    ("MMGATE_VIDEO_APPLY_ROTATION", "sideways"),
    ("MMGATE_ALLOW_PRIVATE_MEDIA_HOSTS", "maybe"),
    ("SMG_VIDEO_PROCESS_TIMEOUT_SECS", "soon"),
    ("SMG_MM_PIXEL_CACHE_MB", "-5"),
    ("SMG_IMAGE_MAX_COUNT", "two"),
    ("MMGATE_IMAGE_BACKEND", "opencv"),
])
def test_an_unreadable_variable_stops_every_command_naming_it(var: str, value: str) -> None:
    with pytest.raises(SystemExit) as gateway:
        serve({var: value})
    assert var in str(gateway.value.code)
    if var in GATEWAY_ONLY:
        return
    with pytest.raises(SystemExit) as engine:
        parse_args(["--model", "/m"], {var: value})
    parser = sidecar_parser()
    with pytest.raises(SystemExit) as sidecar:
        processing_config(parser.parse_args(["--model", "m"]), parser, {var: value})
    assert str(engine.value.code) == str(sidecar.value.code) == str(gateway.value.code)


def test_an_out_of_range_flag_names_the_flag() -> None:
    with pytest.raises(SystemExit) as exc:
        serve({}, "--image-max-input-bytes", "0")
    assert str(exc.value.code) == "--image-max-input-bytes must be at least 1"


def test_serve_help_is_grouped_by_topic_and_names_each_variable() -> None:
    out = subprocess.run([sys.executable, "-m", "mmgate.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    headings = [line[:-1] for line in out.splitlines() if line and not line[0].isspace() and line.endswith(":")]
    assert headings == ["options", "model and server", "media intake", "video", "audio", "tensor transport",
                        "processing mode", "workers", "routing policy", "HTTP limits", "API keys",
                        "structured outputs and tools", "memory", "logging and metrics"]
    text = " ".join(out.split())
    for var in ("MMGATE_MODEL_PATH", "SMG_IMAGE_MAX_INPUT_BYTES", "SMG_MM_TENSOR_TRANSPORT",
                "SMG_TOKENSPEED_MM_TENSOR_TRANSPORT (deprecated)", "SMG_MM_PROCESSING (deprecated)",
                "SMG_LOG_MM_TIMING (deprecated)", "MMGATE_VIDEO_APPLY_ROTATION"):
        assert var in text, var

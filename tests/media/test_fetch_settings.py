"""Media-intake flags and their environment fallbacks (flag, then environment, then default)."""

from __future__ import annotations

import pytest

from mmgate.config.settings import (
    DEFAULT_AUDIO_MAX_BYTES,
    DEFAULT_IMAGE_MAX_BYTES,
    DEFAULT_VIDEO_MAX_BYTES,
    FetchSettings,
    parse_settings,
)


def fetch_settings(*flags: str, **env: str) -> FetchSettings:
    return parse_settings(["--model", "m", *flags], env).fetch


def test_defaults_refuse_private_hosts_and_ignore_exif_like_the_reference() -> None:
    fs = fetch_settings()
    assert fs.allow_private_hosts is False and fs.allowed_domains == ()
    assert fs.image_apply_exif_orientation is False
    assert (fs.image_max_bytes, fs.video_max_bytes, fs.audio_max_bytes) == (
        DEFAULT_IMAGE_MAX_BYTES, DEFAULT_VIDEO_MAX_BYTES, DEFAULT_AUDIO_MAX_BYTES)
    assert fs.max_redirects == 3 and 0 < fs.connect_timeout_s <= fs.total_timeout_s


@pytest.mark.parametrize("modality,flag,env", [
    ("image", "--image-max-input-bytes", "SMG_IMAGE_MAX_INPUT_BYTES"),
    ("video", "--video-max-input-bytes", "SMG_VIDEO_MAX_INPUT_BYTES"),
    ("audio", "--audio-max-input-bytes", "SMG_AUDIO_MAX_INPUT_BYTES"),
])
def test_byte_cap_per_modality_flag_beats_env_beats_default(modality: str, flag: str, env: str) -> None:
    assert fetch_settings(**{env: "1234"}).max_input_bytes(modality) == 1234
    assert fetch_settings(flag, "99", **{env: "1234"}).max_input_bytes(modality) == 99
    with pytest.raises(SystemExit):
        fetch_settings(**{env: "lots"})
    with pytest.raises(SystemExit):
        fetch_settings(flag, "0")


def test_policy_flags() -> None:
    fs = fetch_settings("--mm-allowed-media-domains", "CDN.Example.com.", "media.test",
                        "--mm-allow-private-media-hosts", "--mm-image-apply-exif-orientation",
                        "--mm-fetch-timeout", "7", "--mm-fetch-connect-timeout", "1.5", "--mm-fetch-read-timeout", "2",
                        "--mm-max-redirects", "0", "--mm-image-max-pixels", "1000000")
    assert fs.allowed_domains == ("cdn.example.com", "media.test")
    assert fs.allow_private_hosts and fs.image_apply_exif_orientation
    assert (fs.total_timeout_s, fs.connect_timeout_s, fs.read_timeout_s) == (7.0, 1.5, 2.0)
    assert fs.max_redirects == 0 and fs.max_image_pixels == 1_000_000


def test_private_hosts_env_fallback() -> None:
    assert fetch_settings(MMGATE_ALLOW_PRIVATE_MEDIA_HOSTS="1").allow_private_hosts is True
    assert fetch_settings(MMGATE_ALLOW_PRIVATE_MEDIA_HOSTS="no").allow_private_hosts is False


@pytest.mark.parametrize("flags", [["--mm-fetch-timeout", "0"], ["--mm-max-redirects", "-1"],
                                   ["--mm-image-max-pixels", "0"]])
def test_unusable_values_stop_start_up(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        fetch_settings(*flags)

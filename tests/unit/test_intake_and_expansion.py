"""Unit behaviour of data-URL intake, anchor splicing, smart_resize and the error table."""

from __future__ import annotations

import base64

import pytest

from mmgate.errors import ERROR_TABLE, ErrorCode, GatewayError
from mmgate.media.fetch import check_scheme, decode_data_url, is_public_address
from mmgate.models.geometry import smart_resize
from mmgate.pipeline.planning import splice_anchors
from mmgate.types import PlaceholderRange

PAYLOAD = bytes(range(256)) * 3


def test_data_url_base64_round_trips() -> None:
    url = "data:image/png;base64," + base64.b64encode(PAYLOAD).decode()
    assert decode_data_url(url, 10_000) == PAYLOAD


@pytest.mark.parametrize("variant", ["wrapped", "unpadded", "urlsafe", "charset"])
def test_data_url_lenient_variants_are_accepted(variant: str) -> None:
    b64 = base64.b64encode(PAYLOAD[:100]).decode()
    header = "data:image/png;base64,"
    if variant == "wrapped":
        b64 = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
    elif variant == "unpadded":
        b64 = b64.rstrip("=")
    elif variant == "urlsafe":
        b64 = base64.urlsafe_b64encode(PAYLOAD[:100]).decode()
    else:
        header = "data:image/png;charset=utf-8;base64,"
    assert decode_data_url(header + b64, 10_000) == PAYLOAD[:100]


def test_data_url_garbage_is_invalid_media_url() -> None:
    with pytest.raises(GatewayError) as err:
        decode_data_url("data:image/png;base64,@@@@!!!", 10_000)
    assert err.value.code is ErrorCode.INVALID_MEDIA_URL
    with pytest.raises(GatewayError) as err:
        decode_data_url("data:image/png;base64", 10_000)
    assert err.value.code is ErrorCode.INVALID_MEDIA_URL


def test_data_url_over_cap_is_413_before_decoding() -> None:
    url = "data:image/png;base64," + base64.b64encode(PAYLOAD).decode()
    with pytest.raises(GatewayError) as err:
        decode_data_url(url, 100)
    assert err.value.code is ErrorCode.MEDIA_TOO_LARGE and err.value.status == 413


@pytest.mark.parametrize("url,code", [
    ("file:///etc/passwd", ErrorCode.UNSUPPORTED_MEDIA_URL_SCHEME),
    ("ftp://host/x", ErrorCode.UNSUPPORTED_MEDIA_URL_SCHEME),
    ("no-scheme-here", ErrorCode.INVALID_MEDIA_URL),
    ("", ErrorCode.INVALID_MEDIA_URL),
])
def test_scheme_check_refuses_everything_but_http_https_data(url: str, code: ErrorCode) -> None:
    with pytest.raises(GatewayError) as err:
        check_scheme(url)
    assert err.value.code is code


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                                     "100.64.0.1", "0.0.0.0", "::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
                                     "fe80::1", "fc00::1", "224.0.0.1"])
def test_private_and_special_addresses_are_not_public(address: str) -> None:
    assert not is_public_address(address)


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"])
def test_global_addresses_are_public(address: str) -> None:
    assert is_public_address(address)


def test_splice_replaces_each_anchor_and_records_ranges() -> None:
    ids = [1, 9, 2, 9, 3]
    out, ranges = splice_anchors(ids, 9, [(7, 7), (8, 8, 8)], [(0, 2), (0, 3)])
    assert out == [1, 7, 7, 2, 8, 8, 8, 3]
    assert ranges == [PlaceholderRange(1, 2), PlaceholderRange(4, 3)]


def test_splice_honours_embed_offset_inside_the_run() -> None:
    out, ranges = splice_anchors([5, 9], 9, [(100, 7, 7, 101)], [(1, 2)])
    assert out == [5, 100, 7, 7, 101]
    assert ranges == [PlaceholderRange(2, 2)]


def test_tiny_image_is_upscaled_to_min_pixels() -> None:
    # 1x1 with factor 28, min 3136 = 56*56: beta = sqrt(3136/1) = 56 -> ceil(56/28)*28 = 56 each side.
    assert smart_resize(1, 1, 28, 3136, 12845056) == (56, 56)


def test_sizes_round_to_the_nearest_factor_multiple() -> None:
    # 480/28 = 17.14 -> 17*28 = 476; 640/28 = 22.86 -> 23*28 = 644.
    assert smart_resize(480, 640, 28, 3136, 12845056) == (476, 644)


def test_large_image_is_scaled_below_max_pixels() -> None:
    # 4000x3000 > 1003520 (28*28*1280): beta = sqrt(12e6/1003520) = 3.458; floor(4000/3.458/28)*28 = 1148,
    # floor(3000/3.458/28)*28 = 840.
    h, w = smart_resize(4000, 3000, 28, 3136, 28 * 28 * 1280)
    assert (h, w) == (1148, 840) and h * w <= 28 * 28 * 1280


def test_aspect_ratio_above_200_is_refused() -> None:
    assert smart_resize(1, 200, 28, 3136, 12845056)[1] % 28 == 0
    with pytest.raises(GatewayError) as err:
        smart_resize(1, 201, 28, 3136, 12845056)
    assert err.value.code is ErrorCode.IMAGE_ASPECT_RATIO_INVALID and err.value.status == 400


def test_error_table_statuses() -> None:
    assert ERROR_TABLE[ErrorCode.MEDIA_FETCH_TIMEOUT].status == 503 and ERROR_TABLE[ErrorCode.MEDIA_FETCH_TIMEOUT].retryable
    assert all(spec.status < 500 for code, spec in ERROR_TABLE.items() if spec.type == "invalid_request_error")
    body = GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "bad", "messages[0]").body()
    assert body == {"error": {"type": "invalid_request_error", "code": "media_decode_failed", "message": "bad",
                              "param": "messages[0]"}}

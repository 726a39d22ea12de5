"""``data:`` URL leniency, as documented in docs/media-intake.md (one row per decision)."""

from __future__ import annotations

import base64
import binascii
import urllib.parse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media import data_url
from mmgate.media.data_url import decode_data_url

RAW = bytes(range(256)) * 2 + b"\xfb\xff\xfe"  # has '+', '/' and needs padding in base64
B64 = base64.b64encode(RAW).decode()
URLSAFE = base64.urlsafe_b64encode(RAW).decode()
assert B64.endswith("=") and ("+" in B64 or "/" in B64) and ("-" in URLSAFE or "_" in URLSAFE)

ACCEPTED = {
    "canonical": f"data:image/png;base64,{B64}",
    "charset_param": f"data:image/png;charset=utf-8;base64,{B64}",
    "several_params": f"data:image/png;name=x.png;charset=US-ASCII;base64,{B64}",
    "uppercase_scheme_and_flag": f"DATA:IMAGE/PNG;BASE64,{B64}",
    "space_after_comma": f"data:image/png;base64, {B64}",
    "space_around_params": f"data:image/png ; base64 ,{B64}",
    "wrapped_76_lf": "data:image/png;base64," + "\n".join(B64[i:i + 76] for i in range(0, len(B64), 76)),
    "wrapped_64_crlf": "data:image/png;base64," + "\r\n".join(B64[i:i + 64] for i in range(0, len(B64), 64)),
    "missing_padding": f"data:image/png;base64,{B64.rstrip('=')}",
    "urlsafe_alphabet": f"data:image/png;base64,{URLSAFE}",
    "urlsafe_unpadded": f"data:image/png;base64,{URLSAFE.rstrip('=')}",
    "mixed_alphabets": f"data:image/png;base64,{B64[:40]}{URLSAFE[40:]}",
    "percent_encoded_base64": "data:image/png;base64," + urllib.parse.quote(B64, safe=""),
    "wrong_declared_type": f"data:image/jpeg;base64,{B64}",
    "generic_type": f"data:image;base64,{B64}",
    "no_type": f"data:;base64,{B64}",
    "non_image_type": f"data:application/octet-stream;base64,{B64}",
    "plain_percent_encoded": "data:image/png," + urllib.parse.quote_from_bytes(RAW),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_lenient_variant_is_accepted(name: str) -> None:
    assert decode_data_url(ACCEPTED[name], 10_000) == RAW


REFUSED = {
    "missing_comma": (f"data:image/png;base64{B64[:40]}", ErrorCode.INVALID_MEDIA_URL),
    "not_base64_characters": ("data:image/png;base64,@@@@!!!!", ErrorCode.INVALID_MEDIA_URL),
    "non_ascii_payload": ("data:image/png;base64,aGVsbG8gd29ybGQ\u00e9", ErrorCode.INVALID_MEDIA_URL),
    "impossible_length": ("data:image/png;base64,AAAAA", ErrorCode.INVALID_MEDIA_URL),
    "padding_inside": ("data:image/png;base64,AA==AAAA", ErrorCode.INVALID_MEDIA_URL),
    "empty_payload": ("data:image/png;base64,", ErrorCode.MEDIA_DECODE_FAILED),
    "only_whitespace": ("data:image/png;base64, \n\t", ErrorCode.MEDIA_DECODE_FAILED),
    "empty_plain_payload": ("data:image/png,", ErrorCode.MEDIA_DECODE_FAILED),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_malformed_variant_is_refused_with_a_400_code(name: str) -> None:
    url, code = REFUSED[name]
    with pytest.raises(GatewayError) as err:
        decode_data_url(url, 10_000)
    assert err.value.code is code and err.value.status == 400


def test_payload_over_the_cap_is_413_and_judged_before_decoding() -> None:
    with pytest.raises(GatewayError) as err:
        decode_data_url(f"data:image/png;base64,{B64}", len(RAW) - 1)
    assert err.value.code is ErrorCode.MEDIA_TOO_LARGE and err.value.status == 413
    with pytest.raises(GatewayError) as err:  # far over the cap: refused from the length alone
        decode_data_url("data:image/png;base64," + "A" * 5_000_000, 1000)
    assert err.value.code is ErrorCode.MEDIA_TOO_LARGE


def test_whitespace_does_not_count_against_the_cap() -> None:
    wrapped = "data:image/png;base64," + "\n".join(B64[i:i + 4] for i in range(0, len(B64), 4))
    assert decode_data_url(wrapped, len(RAW)) == RAW


def test_messages_never_quote_the_payload() -> None:
    secret = base64.b64encode(b"SECRET-PAYLOAD-" * 20).decode()
    for url in (f"data:image/png;base64,{secret}!", f"data:image/png;base64{secret}"):
        with pytest.raises(GatewayError) as err:
            decode_data_url(url, 10_000)
        assert secret[:12] not in err.value.message


_B64_TEXT = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_=% \n", max_size=40)


@settings(max_examples=1000, deadline=None)
@given(_B64_TEXT)
def test_the_fast_base64_decoder_accepts_and_refuses_what_binascii_strict_does(payload: str) -> None:
    """The decode runs through ``pybase64`` when installed; the reference is the stdlib's strict decoder
    applied to the same cleaned text (the module's rules: whitespace, escapes, URL-safe alphabet, padding)."""
    space = b" \t\r\n\f\v"
    cleaned = urllib.parse.unquote_to_bytes(payload.encode().translate(None, space)).translate(None, space)
    cleaned = cleaned.replace(b"-", b"+").replace(b"_", b"/").rstrip(b"=")
    try:
        expected: bytes | None = binascii.a2b_base64(cleaned + b"=" * (-len(cleaned) % 4), strict_mode=True)
        if len(cleaned) % 4 == 1:
            expected = None
    except (binascii.Error, ValueError):
        expected = None
    try:
        got: bytes | None = decode_data_url("data:image/png;base64," + payload, 1 << 20)
    except GatewayError as exc:
        assert exc.code in (ErrorCode.INVALID_MEDIA_URL, ErrorCode.MEDIA_DECODE_FAILED)
        got = None
    if expected == b"":
        expected = None  # an empty payload is refused (media_decode_failed)
    assert got == expected


def test_the_gateway_decodes_base64_with_pybase64() -> None:
    """pybase64 is a dependency (pyproject.toml): the fast path is the one that runs."""
    assert data_url.HAVE_PYBASE64
    assert data_url.b64decode_strict(base64.b64encode(RAW)) == RAW

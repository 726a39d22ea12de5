"""Reference-size checks: an inline ``data:`` URL judged by its length before any byte is decoded.

Stage: plan (media references).  In: the media references of a request and the fetch settings' byte
caps; out: nothing, or a refusal.  Used by the gateway when it forwards references to a worker that
processes media itself (:mod:`mmgate.routing.media_refs`) and by the reference engine's media
processor (:mod:`mmgate.refengine.mm_processor`), so neither needs the other's stage.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmgate.config.settings import FetchSettings
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.fetch import url_scheme
from mmgate.types import MediaRef


def data_url_bytes(url: str) -> int | None:
    """Decoded size of a ``data:`` URL's payload, computed without decoding it; None for other URLs."""
    if url_scheme(url) != "data":
        return None
    header, _, payload = url.partition(",")
    if "base64" in [p.strip().lower() for p in header.split(";")[1:]]:
        chars = len(payload) - sum(payload.count(c) for c in " \t\r\n\f\v") - payload.count("=")
        return chars * 3 // 4
    return len(payload) - 2 * payload.count("%")


def check_ref_sizes(refs: Sequence[MediaRef], fetch: FetchSettings) -> None:
    """Refuse an inline ``data:`` URL larger than its modality's byte cap.

    Raises:
        GatewayError(MEDIA_REF_TOO_LARGE): 400, naming the part.
    """
    for ref in refs:
        size = data_url_bytes(ref.url)
        cap = fetch.max_input_bytes(ref.modality.value)
        if size is not None and size > cap:
            raise GatewayError(ErrorCode.MEDIA_REF_TOO_LARGE,
                               f"inline {ref.modality.value} payload of {size} bytes exceeds the {cap}-byte cap",
                               ref.param)

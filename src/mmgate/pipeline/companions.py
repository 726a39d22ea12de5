"""Companion items: a clip's audio track as an audio item with no anchor of its own.

Stage: between fetch+decode and expand (:meth:`mmgate.pipeline.prepare.Pipeline.process_media`).  In: the
request's items grouped by modality, each clip decoded with its audio track where its processor asked for
it (:class:`~mmgate.models.family.AudioTrackVideo`, :attr:`~mmgate.types.DecodedVideo.audio`); out: the same
groups with one more audio item per such clip, and which clip hosts each audio item.

Invariants (the reference's, transformers 5.24 ``OmniModalProcessorMixin.__call__`` with
``load_audio_from_video``, and vLLM's ``_derive_audio_from_video_placeholders``):

* a companion sits in the audio group at its clip's prompt position, so the audio batch is in the order of
  the reference's ``audio`` list (standalone parts and clips' tracks by prompt position);
* it is planned, hashed (its content hash is the clip's bytes, its fingerprint the audio processor's) and
  preprocessed as any audio item;
* it has no anchor: its clip's prompt update carries both runs
  (:meth:`~mmgate.models.family.AudioTrackVideo.expand_with_audio`), and its placeholder range is the span
  from the first to the last audio placeholder token inside the clip's range, so an engine embedding by
  ranges and token ids (the TokenSpeed wire's runs) puts the clip's and the track's rows at their own
  positions of the interleaved run.

Example: a clip's range ``(4, 9)`` over ``[V, V, A, A, V, V, A, V, V]`` (video ``V``, audio ``A``) gives its
companion the range ``(6, 5)``: from the first ``A`` to the last.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, TypeVar

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.family import AudioTrackVideo, MediaProcessor
from mmgate.types import DecodedVideo, ItemPlan, MediaRef, Modality, PlaceholderRange, Replacement

#: per audio item of the request, in the audio group's order: the index of its host clip in the video group,
#: or None for an audio part of its own
Hosts = list[int | None]
T = TypeVar("T")


def add_companions(groups: MutableMapping[Modality, list[MediaRef]], decoded: MutableMapping[Modality, list[Any]]
                   ) -> Hosts | None:
    """Put each decoded clip's audio track into the audio group, at the clip's prompt position (mutates both).

    Returns:
        The hosts of the audio group's items, or None when no clip brought a track (nothing changed).
    """
    clips = decoded.get(Modality.VIDEO, [])
    tracks = [(i, clip) for i, clip in enumerate(clips) if isinstance(clip, DecodedVideo) and clip.audio is not None]
    if not tracks:
        return None
    refs = groups.get(Modality.AUDIO, [])
    items: list[tuple[int, int, MediaRef, Any, int | None]] = [
        (r.part_index, 1, r, d, None) for r, d in zip(refs, decoded.get(Modality.AUDIO, []))]
    for i, clip in tracks:
        ref = groups[Modality.VIDEO][i]
        track = MediaRef(Modality.AUDIO, ref.url, ref.part_index, ref.param, ref.hints)
        items.append((ref.part_index, 0, track, clip.audio, i))
    items.sort(key=lambda item: (item[0], item[1]))
    groups[Modality.AUDIO] = [item[2] for item in items]
    decoded[Modality.AUDIO] = [item[3] for item in items]
    return [item[4] for item in items]


def expand_hosts(reps: MutableMapping[Modality, list[Replacement]], plans: Mapping[Modality, Sequence[Any]],
                 procs: Mapping[Modality, MediaProcessor], hosts: Hosts) -> None:
    """Each host clip's prompt update replaced by its interleaved one, from the clip's and its track's plans
    (``plans``: per modality, in the groups' order; mutates ``reps``).

    Raises:
        GatewayError(INTERNAL_ERROR): a clip has a track but its processor cannot interleave it.
    """
    video = procs[Modality.VIDEO]
    if not isinstance(video, AudioTrackVideo):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, "a clip brought an audio track its processor cannot expand")
    for k, host in enumerate(hosts):
        if host is not None:
            reps[Modality.VIDEO][host] = video.expand_with_audio(plans[Modality.VIDEO][host],
                                                                 plans[Modality.AUDIO][k])


def anchored(per_item: Mapping[Modality, list[T]], hosts: Hosts | None) -> dict[Modality, list[T]]:
    """The entries (prompt updates, hashes) of the items that replace an anchor: every one but the companions'."""
    out = dict(per_item)
    if hosts is not None and Modality.AUDIO in out:
        out[Modality.AUDIO] = [entry for entry, host in zip(out[Modality.AUDIO], hosts) if host is None]
    return out


def companion_ranges(ids: Sequence[int], ranges: MutableMapping[Modality, list[PlaceholderRange]], hosts: Hosts,
                     token_id: int) -> None:
    """The audio group's ranges in its order (mutates ``ranges``): an anchored item's own, a companion's the span
    of ``token_id`` (the audio placeholder) inside its clip's range (module docstring).

    Raises:
        GatewayError(INTERNAL_ERROR): a clip's range holds no ``token_id``.
    """
    own = iter(ranges.get(Modality.AUDIO, []))
    out: list[PlaceholderRange] = []
    for host in hosts:
        if host is None:
            out.append(next(own))
            continue
        clip = ranges[Modality.VIDEO][host]
        hits = [i for i in range(clip.offset, clip.offset + clip.length) if ids[i] == token_id]
        if not hits:
            raise GatewayError(ErrorCode.INTERNAL_ERROR, "a clip's interleaved run holds no audio placeholder")
        out.append(PlaceholderRange(hits[0], hits[-1] + 1 - hits[0]))
    ranges[Modality.AUDIO] = out


def in_prompt_order(media: Sequence[MediaRef], items: Mapping[Modality, Sequence[ItemPlan]],
                    hosts: Hosts | None) -> tuple[ItemPlan, ...]:
    """Every item's plan in prompt order (``media``: the request's parts), a companion right after its clip."""
    audio = len(items.get(Modality.AUDIO, ()))
    hosted = {host: k for k, host in enumerate(hosts or ()) if host is not None}
    own = {m: iter(range(len(plans))) for m, plans in items.items()}
    own[Modality.AUDIO] = iter([k for k, host in enumerate(hosts or [None] * audio) if host is None])
    out: list[ItemPlan] = []
    for ref in media:
        k = next(own[ref.modality])
        out.append(items[ref.modality][k])
        if ref.modality is Modality.VIDEO and k in hosted:
            out.append(items[Modality.AUDIO][hosted[k]])
    return tuple(out)

"""Each routing policy's choice on small hand-written traces (docs/routing.md).

The expected worker of every step is written out.  The ring positions behind consistent_hashing and
prefix_hash were computed once by an independent script from the Rust gateway's ring rule (lightseekorg/smg
``model_gateway/src/worker/hash_ring.rs``: 150 virtual nodes ``blake3(f"{url}#{i}")``, first 8 bytes
little-endian, first node clockwise), not by the code under test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from mmgate.config.settings import RoutingSettings, parse_settings
from mmgate.engines.base import Capabilities, Probe, ProbeOutcome, Role, Wire
from mmgate.engines.capabilities import worker_modalities
from mmgate.engines.loads import KvBatch, KvBlock, KvCleared, KvRemoved, KvStored, WorkerLoad
from mmgate.errors import ErrorCode, GatewayError
from mmgate.pipeline.routing_key import MEDIA_BASE, RoutingKey, expanded_key
from mmgate.routing.disagg import select_pair
from mmgate.routing.policies import make_policy, policies_for
from mmgate.routing.policies.base import RouteRequest, request_headers
from mmgate.routing.policies.cache_aware import CacheAwarePolicy
from mmgate.routing.policies.consistent_hashing import ConsistentHashingPolicy
from mmgate.routing.policies.least_load import LeastLoadPolicy
from mmgate.routing.policies.power_of_two import PowerOfTwoPolicy
from mmgate.routing.policies.prefix_hash import PrefixHashPolicy
from mmgate.routing.policies.random import RandomPolicy
from mmgate.routing.policies.round_robin import RoundRobinPolicy
from mmgate.routing.workers import HealthPolicy, WorkerRegistry
from mmgate.types import Modality


@dataclass
class W:
    url: str
    in_flight: int = 0


A, B, C = W("grpc://a:1"), W("grpc://b:1"), W("grpc://c:1")
ANCHOR = 9  # the image anchor of the hand-written prompts


def fresh(*workers: W) -> list[W]:
    return [W(w.url) for w in workers]


def key(*ids: int) -> RouteRequest:
    return RouteRequest(RoutingKey.text(ids))


def image_prompt(text: list[int], image: str, after: list[int], run: int = 8) -> RouteRequest:
    """``text`` + one image (an anchor expanding to ``run`` ids, keyed by hash ``image``) + ``after``."""
    return RouteRequest(expanded_key([*text, ANCHOR, *after], {ANCHOR: [(image, run)]}))


def test_round_robin_cycles_through_the_candidates() -> None:
    policy = RoundRobinPolicy()
    ws = fresh(A, B, C)
    assert [policy.select(ws, key()).url for _ in range(5)] == [A.url, B.url, C.url, A.url, B.url]


def test_random_draws_from_its_source() -> None:
    policy = RandomPolicy(random.Random(1234))  # random.Random(1234).randrange(3) x 6 = 1, 0, 0, 0, 2, 0
    ws = fresh(A, B, C)
    assert [policy.select(ws, key()).url for _ in range(6)] == [B.url, A.url, A.url, A.url, C.url, A.url]
    assert RandomPolicy().select([ws[2]], key()).url == C.url


def test_power_of_two_compares_kv_usage_when_both_report_else_requests_in_flight() -> None:
    policy = PowerOfTwoPolicy(random.Random(0))
    a, b = W(A.url, in_flight=1), W(B.url, in_flight=7)
    assert policy.pick(a, b).url == A.url  # no loads: in flight, 1 < 7
    policy.update_loads(A.url, WorkerLoad(token_usage=0.9))
    assert policy.pick(a, b).url == A.url  # only one reports: both fall back to in flight
    policy.update_loads(B.url, WorkerLoad(token_usage=0.2))
    assert policy.pick(a, b).url == B.url  # both report: KV usage 0.2 < 0.9
    assert [policy.select([a, b], key()).url for _ in range(3)] == [B.url, B.url, B.url]


def test_least_load_follows_getloads_plus_what_it_sent_since() -> None:
    policy = LeastLoadPolicy()  # SMG defaults: kv weight 0.15 s, 2000 tok/s, mean prefill 1024
    ws = fresh(A, B)
    # A: 4000 queued tokens at 2000 tok/s = 2.0 s.  B: nothing queued, KV half full: 0.15 * 0.5 / 0.5 = 0.15 s.
    policy.update_loads(A.url, WorkerLoad(waiting_uncached_tokens=4000, gen_throughput=2000.0))
    policy.update_loads(B.url, WorkerLoad(token_usage=0.5, gen_throughput=2000.0))
    prompt = key(*range(2000))  # 2000 tokens each
    assert policy.select(ws, prompt).url == B.url  # B 0.15 < A 2.0; B now 2000/2000 + 0.15 = 1.15
    assert policy.select(ws, prompt).url == B.url  # 1.15 < 2.0; B now 2.15
    assert policy.select(ws, prompt).url == A.url  # 2.0 < 2.15
    policy.update_loads(B.url, WorkerLoad(token_usage=0.5, gen_throughput=2000.0))  # a fresh answer resets B
    assert policy.select(ws, prompt).url == B.url


def test_least_load_without_any_report_takes_the_fewest_in_flight() -> None:
    policy = LeastLoadPolicy()
    assert policy.select([W(A.url, 3), W(B.url, 1), W(C.url, 2)], key(1, 2)).url == B.url


def test_consistent_hashing_by_header_then_user_and_stable_when_another_worker_leaves() -> None:
    policy = ConsistentHashingPolicy(random.Random(0))
    ws = fresh(A, B, C)
    assert policy.select(ws, RouteRequest(headers={"x-smg-target-worker": "1"})).url == B.url
    with pytest.raises(GatewayError) as exc:
        policy.select(ws, RouteRequest(headers={"x-smg-target-worker": "3"}))
    assert exc.value.code is ErrorCode.NO_HEALTHY_WORKER
    assert policy.select(ws, RouteRequest(headers={"x-smg-routing-key": "alice"})).url == A.url
    assert policy.select(ws, RouteRequest(headers={"x-smg-routing-key": "bob"})).url == C.url
    assert policy.select(ws, RouteRequest(headers={"authorization": "dave"})).url == B.url
    assert policy.select(ws, RouteRequest(user="carol")).url == C.url
    with request_headers({"X-SMG-Routing-Key": "frank"}):
        assert policy.select(ws, RouteRequest.current(RoutingKey.text([1]))).url == A.url
    # B leaves: only B's keys move (dave goes to A), the others stay.
    rest = [ws[0], ws[2]]
    assert [policy.select(rest, RouteRequest(user=u)).url for u in ("alice", "bob", "dave", "erin")] == [
        A.url, C.url, A.url, C.url]


def test_prefix_hash_sends_a_prefix_to_its_ring_worker_unless_it_is_overloaded() -> None:
    policy = PrefixHashPolicy()  # smg 1.13 defaults: 256 prefix values, load factor 1.25, abs threshold 10
    p1 = key(*range(1, 21))  # ring key 07b171204bf3707a -> a
    p2 = key(*range(100, 120))  # ring key b4daa44a132574e5 -> b
    ws = fresh(A, B, C)
    assert [policy.select(ws, p).url for p in (p1, p2, p1)] == [A.url, B.url, A.url]
    # mean = (total + 1) / 3; A overloaded only past max(mean * 1.25, mean + 10).
    # A 5, B 1, C 0: mean 7/3 = 2.33, bound max(2.92, 12.33) = 12.33: 5 is under it (smg <= 1.9: 2.92, to C).
    assert policy.select([W(A.url, 5), W(B.url, 1), W(C.url, 0)], p1).url == A.url
    # A 16, B 1, C 0: mean 18/3 = 6, bound max(7.5, 16) = 16: 16 is not past it.
    assert policy.select([W(A.url, 16), W(B.url, 1), W(C.url, 0)], p1).url == A.url
    # A 17, B 1, C 0: mean 19/3 = 6.33, bound max(7.92, 16.33) = 16.33: overloaded -> the least loaded under it, C.
    busy = [W(A.url, 17), W(B.url, 1), W(C.url, 0)]
    assert policy.select(busy, p1).url == C.url
    assert policy.select(busy, key()).url == C.url  # no key: least loaded


def test_prefix_hash_abs_threshold_zero_is_the_relative_bound_alone() -> None:
    policy = PrefixHashPolicy(balance_abs_threshold=0)
    p1 = key(*range(1, 21))  # ring worker a
    # A 5, B 1, C 0: mean 7/3 = 2.33, bound max(2.92, 2.33) = 2.92: overloaded -> C.
    assert policy.select([W(A.url, 5), W(B.url, 1), W(C.url, 0)], p1).url == C.url
    # A 3, B 3, C 3: mean 10/3 = 3.33, bound 4.17: every worker fits, the ring's A stays.
    assert policy.select([W(A.url, 3), W(B.url, 3), W(C.url, 3)], p1).url == A.url
    # Every worker overloaded cannot happen (the least loaded is at most the mean), so the ring's worker is
    # kept only when it fits.


def cache_aware(**kw: float) -> CacheAwarePolicy:
    return CacheAwarePolicy(block_size=4, **kw)  # type: ignore[arg-type]


SYSTEM = [1, 2, 3, 4]  # a shared system prompt of one page


def test_the_key_replaces_an_items_run_by_values_of_its_hash() -> None:
    first = image_prompt(SYSTEM, "aa11", [5, 6]).key
    other = image_prompt(SYSTEM, "bb22", [5, 6]).key
    assert first.tokens == (1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 5, 6)
    assert first.values[:4] == other.values[:4] == (1, 2, 3, 4)
    assert first.values[4] != other.values[4]  # the branches part at the image's first position
    assert all(v >= MEDIA_BASE for v in first.values[4:12]) and first.values[12:] == (5, 6)
    assert image_prompt(SYSTEM, "aa11", [7]).key.values[:12] == first.values[:12]


def test_cache_aware_follow_up_about_the_same_image_goes_back_and_another_image_does_not_share() -> None:
    policy = cache_aware()
    ws = fresh(A, B)
    turn1 = image_prompt(SYSTEM, "aa11", [5, 6, 7, 8])  # 16 values
    assert policy.select(ws, turn1).url == A.url  # empty tree: least loaded, first
    other_user = key(*range(50, 66))
    assert policy.select(ws, other_user).url == B.url  # no match: least loaded, fewest chosen (A 1, B 0)
    turn2 = image_prompt(SYSTEM, "aa11", [5, 6, 7, 8, 20, 21, 22, 23])  # the follow-up: 16 of 20 match
    assert policy.select(ws, turn2).url == A.url
    different = image_prompt(SYSTEM, "bb22", [5, 6, 7, 8, 20, 21, 22, 23])
    assert policy.tree.match(different.key.values) == {A.url: 4}  # only the system prompt is shared
    assert policy.select(ws, different).url == B.url  # 4 / 20 < 0.3: least loaded, fewest chosen (A 2, B 1)


def held_by_a(**kw: float) -> tuple[CacheAwarePolicy, RouteRequest]:
    """A cache_aware policy whose tree holds a first turn on A, and the follow-up (20 values, 16 on A)."""
    policy = cache_aware(**kw)
    assert policy.select(fresh(A, B, C), image_prompt(SYSTEM, "aa11", [5, 6, 7, 8])).url == A.url
    return policy, image_prompt(SYSTEM, "aa11", [5, 6, 7, 8, 9, 9, 9, 9])


def test_cache_aware_spill_gate_at_its_boundaries() -> None:
    # hot: in flight > mean * 1.5 AND > mean + min(64, max(4, 2 * sqrt(mean))); mean over A, B, C.
    policy, follow = held_by_a()
    # A 6, B 0, C 0: mean 2, margin max(4, 2.83) = 4 (the floor): 6 > 3 but not > 6: A keeps it.
    assert policy.select([W(A.url, 6), W(B.url, 0), W(C.url, 0)], follow).url == A.url
    # A 7, B 0, C 0: mean 2.33, margin 4: 7 > 3.5 and 7 > 6.33: hot, spills to the least loaded, B
    # (B and C at 0; B has been chosen as often as C, none, and comes first).
    policy, follow = held_by_a()
    assert policy.select([W(A.url, 7), W(B.url, 0), W(C.url, 0)], follow).url == B.url
    # A 12, B 0, C 0: mean 4, margin 2 * sqrt(4) = 4: 12 > 6 and 12 > 8: hot -> B.
    policy, follow = held_by_a()
    assert policy.select([W(A.url, 12), W(B.url, 0), W(C.url, 0)], follow).url == B.url
    # A 12, B 6, C 6: mean 8, margin 2 * sqrt(8) = 5.66: 12 is not > 8 * 1.5 = 12: the relative part holds A.
    policy, follow = held_by_a()
    assert policy.select([W(A.url, 12), W(B.url, 6), W(C.url, 6)], follow).url == A.url


def test_cache_aware_spill_margin_is_capped_at_the_in_flight_swing() -> None:
    # A 120, B 30, C 30: mean 60, margin min(64, 2 * sqrt(60) = 15.49) = 15.49: 120 > 90 and 120 > 75.49:
    # hot -> B.  (Uncapped, as smg 1.10 to 1.12 read the flag: 120 is not > 60 + 64 = 124, A would keep it.)
    policy, follow = held_by_a()
    assert policy.select([W(A.url, 120), W(B.url, 30), W(C.url, 30)], follow).url == B.url
    assert policy.spill_margin(60) == pytest.approx(15.4919, abs=1e-4)
    # A flag under the floor wins: abs 2, A 5, B 0, C 0: mean 1.67, margin min(2, 4) = 2: 5 > 2.5 and 5 > 3.67.
    policy, follow = held_by_a(balance_abs_threshold=2)
    assert policy.select([W(A.url, 5), W(B.url, 0), W(C.url, 0)], follow).url == B.url
    # The default's floor of 4 keeps it on A: 5 is not > 1.67 + 4 = 5.67.
    policy, follow = held_by_a()
    assert policy.select([W(A.url, 5), W(B.url, 0), W(C.url, 0)], follow).url == A.url


def test_cache_aware_a_spill_target_becomes_another_holder_of_the_prefix() -> None:
    policy, follow = held_by_a()
    assert policy.select(fresh(A, B, C), follow).url == A.url  # 16 of 20 on A, A not hot
    assert policy.select([W(A.url, 12), W(B.url, 0), W(C.url, 0)], follow).url == B.url  # spilled (above)
    assert policy.tree.match(follow.key.values) == {A.url: 20, B.url: 20}
    # A 12, B 3, C 0: mean 5, margin 2 * sqrt(5) = 4.47: A hot (12 > 7.5, 12 > 9.47), B not (3):
    # B, the holder that is not hot, although C is less loaded.
    assert policy.select([W(A.url, 12), W(B.url, 3), W(C.url, 0)], follow).url == B.url
    # Both holders hot: A 20, B 20, C 0, D 0 (D a fresh worker): mean 10, margin 6.32: 20 > 15 and > 16.32;
    # the least loaded worker that is not hot: C and D at 0, neither chosen before, C first.
    d = W("grpc://d:1")
    assert policy.select([W(A.url, 20), W(B.url, 20), W(C.url, 0), W(d.url, 0)], follow).url == C.url


def test_cache_aware_a_miss_ignores_the_gate() -> None:
    policy = cache_aware()
    # Nothing matches: the least loaded worker, whatever the gate says of the others.
    assert policy.select([W(A.url, 50), W(B.url, 2), W(C.url, 1)], key(*range(70, 86))).url == C.url


def test_cache_aware_threshold_decides_between_affinity_and_load() -> None:
    policy = cache_aware(cache_threshold=0.5)
    policy.select(fresh(A, B), key(*range(1, 9)))  # A was sent 8 values
    assert policy.select(fresh(A, B), key(*range(1, 9), *range(30, 38))).url == B.url  # 8 / 16 not above 0.5
    assert policy.select(fresh(A, B), key(*range(1, 9), 40, 41, 42, 43)).url == A.url  # 8 / 12 > 0.5


def test_cache_aware_eviction_drops_the_least_recently_used_pages_beyond_the_size() -> None:
    policy = cache_aware(max_tree_size=8)
    ws = fresh(A, B)
    old = key(*range(1, 9))  # 8 values, 2 pages, to A
    new = key(*range(100, 108))  # 8 values, to B (fewest chosen)
    newer = key(*range(100, 108), 200, 201, 202, 203)  # the follow-up: to B, whose share is now 12
    assert [policy.select(ws, r).url for r in (old, new, newer)] == [A.url, B.url, B.url]
    assert policy.tree.sizes == {A.url: 8, B.url: 12}
    policy.evict()
    assert policy.tree.sizes == {A.url: 8, B.url: 8}
    assert policy.tree.match(newer.key.values) == {B.url: 8}  # its last page went
    policy.max_tree_size = 4
    policy.select(ws, new)
    policy.evict()
    assert policy.tree.match(old.key.values) == {A.url: 4}
    assert policy.tree.match(new.key.values) == {B.url: 4}


def kv_block(h: int, tokens: list[int], media: tuple[tuple[str, int], ...] = ()) -> KvBlock:
    return KvBlock(h, tuple(tokens), media)


def test_cache_aware_follows_the_workers_kv_events() -> None:
    policy = cache_aware()
    ws = fresh(A, B)
    # B's engine says it holds two blocks of 4: [1 2 3 4] then the first half of image aa11 (placeholders 9).
    prompt = image_prompt(SYSTEM, "aa11", [5, 6, 7, 8], run=4)  # tokens 1 2 3 4 9 9 9 9 5 6 7 8
    policy.on_kv_events(B.url, KvBatch(1, (KvStored((kv_block(11, [1, 2, 3, 4]),
                                                     kv_block(12, [9, 9, 9, 9], (("aa11", 0),)))),)))
    assert policy.select(ws, prompt).url == B.url
    other_image = image_prompt(SYSTEM, "bb22", [5, 6, 7, 8], run=4)
    policy.on_kv_events(A.url, KvBatch(1, (KvStored((kv_block(21, [1, 2, 3, 4]),
                                                     kv_block(22, [9, 9, 9, 9], (("bb22", 0),)),
                                                     kv_block(23, [5, 6, 7, 8]))),)))
    assert policy.select(ws, other_image).url == A.url  # A holds all 3 blocks, B only the first
    assert policy.select(ws, prompt).url == B.url  # B: 2 blocks; A: 1 (its image is another one)
    policy.on_kv_events(B.url, KvBatch(2, (KvRemoved((12,)),)))  # B evicted the image block
    assert policy.select([W(A.url, 1), W(B.url, 0)], prompt).url == B.url  # both hold 1: the less loaded
    policy.on_kv_events(B.url, KvBatch(3, (KvCleared(),)))
    assert policy.select([W(A.url, 0), W(B.url, 0)], prompt).url == A.url  # only A holds a block now
    policy.on_kv_stream_lost(A.url)  # nobody's events followed: back to the approximate tree
    assert policy.kv == {B.url: policy.kv[B.url]} and not policy.kv[B.url].held


def test_a_store_after_an_unknown_parent_is_skipped() -> None:
    policy = cache_aware()
    policy.on_kv_events(A.url, KvBatch(1, (KvStored((kv_block(31, [1, 2, 3, 4]),), parent=999),)))
    assert not policy.kv[A.url].held


def test_each_role_gets_its_own_policy() -> None:
    routing = RoutingSettings(policy="least_load", prefill_policy="cache_aware", decode_policy="round_robin")
    chosen = policies_for(routing)
    assert {role: p.name for role, p in chosen.items()} == {
        Role.SINGLE: "least_load", Role.PREFILL: "cache_aware", Role.DECODE: "round_robin"}
    assert {p.name for p in policies_for(RoutingSettings()).values()} == {"cache_aware"}
    with pytest.raises(ValueError):
        make_policy("bucket", routing)


def pd_registry(routing: RoutingSettings) -> WorkerRegistry:
    urls = [f"grpc://127.0.0.1:{9100 + i}" for i in range(4)]
    reg = WorkerRegistry([], HealthPolicy(), prefill=[(urls[0], None), (urls[1], None)], decode=urls[2:],
                         routing=routing)
    for worker in reg.workers:
        caps = Capabilities(wire=Wire.VLLM, role=worker.assigned_role or Role.SINGLE, supports_vision=True,
                            modalities=worker_modalities(Wire.VLLM, frozenset({Modality.IMAGE})))
        worker.record_probe(Probe(ProbeOutcome.OK, caps, wire=Wire.VLLM), reg.policy, now=1.0, last_answer=1.0)
        worker.client = object()  # type: ignore[assignment]  # selection only checks that one exists
    return reg


def test_pd_pairs_follow_the_prefill_and_decode_policies() -> None:
    reg = pd_registry(RoutingSettings(prefill_policy="cache_aware", decode_policy="round_robin"))
    p0, p1, d0, d1 = (w.url for w in reg.workers)
    first = image_prompt(SYSTEM, "aa11", [5, 6, 7, 8, 10, 11, 12, 13])
    other = key(*range(60, 76))
    follow = image_prompt(SYSTEM, "aa11", [5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17])
    pairs = [select_pair(reg, frozenset({Modality.IMAGE}), request=r) for r in (first, other, follow)]
    assert [(p.url, d.url) for p, d in pairs] == [(p0, d0), (p1, d1), (p0, d0)]


def test_least_load_skips_workers_at_the_waiting_cap_while_another_is_under_it() -> None:
    policy = LeastLoadPolicy(max_waiting_requests=3)
    ws = fresh(A, B)
    # A: nothing queued in tokens but 2 waiting requests; B: 4000 uncached tokens queued, 0 waiting requests.
    policy.update_loads(A.url, WorkerLoad(waiting=2, gen_throughput=2000.0))
    policy.update_loads(B.url, WorkerLoad(waiting=0, waiting_uncached_tokens=4000, gen_throughput=2000.0))
    prompt = key(*range(100))  # 100 tokens: 0.05 s each at 2000 tok/s
    assert policy.select(ws, prompt).url == A.url  # A 2 + 0 < 3; A 0 s < B 2.0 s
    assert policy.select(ws, prompt).url == B.url  # A 2 + 1 sent since its poll = 3: at the cap, skipped
    policy.update_loads(A.url, WorkerLoad(waiting=2, gen_throughput=2000.0))  # a fresh answer resets the count
    assert policy.select(ws, prompt).url == A.url
    policy.update_loads(B.url, WorkerLoad(waiting=5, gen_throughput=2000.0))
    # A at the cap again (2 + 1), B past it (5): every candidate capped, so all are scored: A holds the 100
    # tokens sent since its poll (0.05 s), B nothing since its fresh answer (0 s): B.
    assert policy.select(ws, prompt).url == B.url
    assert LeastLoadPolicy().max_waiting_requests == 0  # off by default (smg 1.13)


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["--eviction-interval-secs", "30"], "eviction_interval_s", 30.0),
    (["--eviction-interval", "45"], "eviction_interval_s", 45.0),
    (["--cache-match-threshold", "0.6"], "cache_threshold", 0.6),
    (["--spill-abs-threshold", "8"], "balance_abs_threshold", 8),
    (["--spill-rel-threshold", "1.2"], "balance_rel_threshold", 1.2),
    (["--prefix-hash-balance-abs-threshold", "3"], "prefix_hash_balance_abs_threshold", 3),
    (["--least-load-max-waiting-requests", "16"], "least_load_max_waiting_requests", 16),
])
def test_smg_1_13_routing_flags_and_aliases_parse(flags: list[str], field: str, value: float) -> None:
    routing = parse_settings(["--model", "m", *flags], {}).routing
    assert getattr(routing, field) == value


def test_smg_1_13_routing_defaults() -> None:
    routing = parse_settings(["--model", "m"], {}).routing
    # smg 1.13.0 `smg launch --help`: --eviction-interval-secs 60, --prefix-hash-balance-abs-threshold 10,
    # --least-load-max-waiting-requests 0, --balance-abs-threshold 64, --balance-rel-threshold 1.5, 0.3
    assert (routing.eviction_interval_s, routing.prefix_hash_balance_abs_threshold,
            routing.least_load_max_waiting_requests, routing.balance_abs_threshold, routing.balance_rel_threshold,
            routing.cache_threshold) == (60.0, 10, 0, 64, 1.5, 0.3)
    with pytest.raises(SystemExit):
        parse_settings(["--model", "m", "--spill-rel-threshold", "0.9"], {})  # smg: at least 1.0

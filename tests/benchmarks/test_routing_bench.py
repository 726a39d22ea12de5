"""The routing benchmark's machinery at a tiny size (``benchmarks/routing_sim.py``, ``benchmarks/recording_worker.py``).

Expected values are worked out by hand in the comments, from vLLM's prefix-cache rules the simulation
mirrors (full blocks only, chained keys, media keyed by content, the last prompt token always computed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from routing_sim import PrefixCache, block_keys, load_spread, make_trace, oracle, system_prompts  # noqa: E402

from mmgate.cli.launch import Child, free_port, wait_grpc_health  # noqa: E402

MODELS = Path(os.environ.get("MMGATE_MODEL_PATH", REPO.parent / "shared" / "models"))
BUNDLE = MODELS / "Qwen--Qwen3-VL-2B-Instruct"


def test_block_keys_chain_and_key_media_by_content() -> None:
    text = list(range(100, 112))  # 12 text tokens, then an 8-token image run, then 4 text tokens
    ids = text + [7] * 8 + [200, 201, 202, 203]  # 24 tokens: three blocks of 8
    cat = block_keys(ids, [(12, 8, "cat")], block=8)
    dog = block_keys(ids, [(12, 8, "dog")], block=8)
    assert len(cat) == 3 and len(set(cat)) == 3
    # block 0 (tokens 0-7) holds no placeholder: shared; block 1 (8-15) holds the image's first 4 tokens:
    # different images, different keys, and every later key differs too (the chain)
    assert cat[0] == dog[0]
    assert cat[1] != dog[1] and cat[2] != dog[2]
    # same image, same keys; a trailing partial block has no key
    assert block_keys(ids + [1, 2, 3], [(12, 8, "cat")], block=8) == cat
    # a change in block 0 changes every key
    assert set(block_keys([99] + ids[1:], [(12, 8, "cat")], block=8)).isdisjoint(cat)


def test_prefix_cache_counts_the_longest_cached_block_prefix() -> None:
    a = list(range(16))  # 4 blocks of 4
    ka = block_keys(a, [], block=4)
    cache = PrefixCache(capacity=4)
    assert cache.serve(ka[:2], 10, block=4) == 0  # 10 tokens: 2 full blocks, nothing cached yet
    assert cache.serve(ka[:2], 10, block=4) == 8  # both blocks: (10 - 1) // 4 = 2 may serve
    assert cache.serve(ka, 16, block=4) == 8  # 16 tokens: up to (16 - 1) // 4 = 3 blocks, 2 cached
    assert cache.serve(ka[:2], 8, block=4) == 4  # 8 tokens: the last token is computed, so 1 block
    # cache (least recent first): a3 a2 a1 a0 (tail touched first). Two new blocks evict a3 and a2.
    kb = block_keys(list(range(50, 58)), [], block=4)
    assert cache.serve(kb, 8, block=4) == 0
    assert len(cache) == 4
    assert cache.serve(ka, 16, block=4) == 8  # a0 a1 survived, a2 was evicted: 2 blocks


def test_trace_is_deterministic_and_multi_turn() -> None:
    t1, t2 = make_trace(seed=3, users=12), make_trace(seed=3, users=12)
    assert t1 == t2
    assert make_trace(seed=4, users=12) != t1
    assert len(t1.conversations) == 12
    kinds = {m.kind for m in t1.media()}
    assert kinds == {"image", "video"}
    users_of: dict[str, set[str]] = {}
    for c in t1.conversations:
        assert 2 <= len(c.questions) <= 5 and len(c.answers) == len(c.questions) - 1
        for m in c.media:
            users_of.setdefault(m.name, set()).add(c.user)
    assert any(name.startswith("hot") and len(users) > 1 for name, users in users_of.items())
    conv = t1.conversations[0]
    media = [{"type": "image_url", "image_url": {"url": "x"}}]
    turn1, turn2 = conv.messages(1, media), conv.messages(2, media) if len(conv.questions) > 2 else None
    # turn 1 = system, user (media + question 0), assistant (answer 0), user (question 1)
    assert [m["role"] for m in turn1] == ["system", "user", "assistant", "user"]
    assert turn1[1]["content"][0] == media[0] and turn1[2]["content"] == conv.answers[0]
    if turn2 is not None:
        assert turn2[:4] == turn1  # each turn appends to the previous one
    systems = [c.system for c in t1.conversations]
    assert set(systems) <= set(system_prompts()) and max(systems.count(s) for s in systems) > 1  # shared


def test_oracle_routes_to_the_longest_cached_prefix_within_the_spread_bound() -> None:
    p = block_keys(list(range(32)), [], block=4)  # 8 blocks
    q = block_keys(list(range(100, 132)), [], block=4)
    prompts = [(32, p), (32, q), (32, p), (32, p)]
    # unbounded: p -> w0 (all empty, fewest requests, lowest index); q -> w1 (no match anywhere, w1 has fewer);
    # p again -> w0 (7 of 8 blocks cached: (32 - 1) // 4 = 7), p again -> w0 (7 blocks)
    free = oracle(prompts, workers=2, capacity=64, max_spread=float("inf"), block=4)
    assert free.requests == [3, 1] and free.hit_tokens == 2 * 7 * 4 and free.prompt_tokens == 128
    # bound 1.0: after 4 requests at most ceil(1.0 * 4 / 2) = 2 each, so the last p must go to w1 (a miss)
    even = oracle(prompts, workers=2, capacity=64, max_spread=1.0, block=4)
    assert even.requests == [2, 2] and even.hit_tokens == 7 * 4
    assert load_spread([3, 1]) == 1.5 and load_spread([2, 2]) == 1.0


@pytest.fixture(scope="module")
def recording_workers():
    ports = [free_port(), free_port()]
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "recording_worker.py"), "--model", str(BUNDLE),
                             "--ports", *map(str, ports), "--capacity-blocks", "64", "--service-ms", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    child = Child("recording-workers", proc, ports[0], None)
    try:
        for port in ports:
            wait_grpc_health(Child("recording-workers", proc, port, None), timeout_s=60)

        def control(command: str):
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(command.encode() + b"\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())

        yield ports, control
    finally:
        child.stop()


def _request(ids: list[int], pixels: np.ndarray, grid: list[int], offset: int) -> vllm_engine_pb2.GenerateRequest:
    mm = vllm_engine_pb2.MultimodalInputs(
        pixel_values=vllm_engine_pb2.TensorData(shape=list(pixels.shape), dtype="float32", inline=pixels.tobytes()),
        mm_placeholders=[vllm_engine_pb2.PlaceholderRange(offset=offset, length=int(np.prod(grid)) // 4)],
        mm_hashes=[f"h{float(pixels[0, 0])}"])
    mm.model_specific_tensors["image_grid_thw"].CopyFrom(vllm_engine_pb2.TensorData(
        shape=[1, 3], dtype="int64", inline=np.array([grid], dtype=np.int64).tobytes()))
    return vllm_engine_pb2.GenerateRequest(request_id="r", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
                                           sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=1), mm_inputs=mm)


def test_recording_worker_counts_hits_over_grpc(recording_workers) -> None:
    ports, control = recording_workers
    assert control("reset") == {"ok": True}
    # 20 text tokens, a 16-token image (grid 1x8x8 = 64 rows, merge 2x2 -> 16 placeholders), 12 text tokens: 48
    ids = list(range(1000, 1020)) + [151655] * 16 + list(range(2000, 2012))
    red, blue = np.full((64, 8), 0.25, dtype=np.float32), np.full((64, 8), 0.75, dtype=np.float32)
    with grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as ch:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        for req in (_request(ids, red, [1, 8, 8], 20), _request(ids, red, [1, 8, 8], 20),
                    _request(ids, blue, [1, 8, 8], 20)):
            out = list(stub.Generate(req, timeout=10))
            assert out[-1].complete.prompt_tokens == 48
    stats = control("stats")
    # first: 0; same image again: (48 - 1) // 16 = 2 of 3 blocks -> 32; other image: block 0 (tokens 0-15, text)
    # is shared, block 1 (16-31) holds the image -> 16
    assert stats[0] == {"worker": 0, "requests": 3, "prompt_tokens": 144, "cached_tokens": 48, "mm_items": 3,
                        "mm_items_keyed_by_rows": 3, "mm_hashes_sent": 3, "hash_mismatches": 0}
    assert stats[1]["requests"] == 0
    log = control("log")
    assert [(w, n, cached) for _, w, n, cached, _ in log] == [(0, 48, 0), (0, 48, 32), (0, 48, 16)]
    assert log[0][4] == log[1][4] and log[0][4][0] == log[2][4][0] and log[0][4][1] != log[2][4][1]

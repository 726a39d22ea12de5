"""Chat completions fields end to end: each field through a real gateway to the reference engine has its effect.

One ``mmgate serve`` + ``mmgate engine`` pair (child processes, loopback) serves the module.  The engine
runs Qwen2-VL with shrunken random weights, so texts are noise, but token-level effects are exact: a
``logit_bias`` of +100 forces its token, ``min_tokens`` holds the forced stop token off for exactly that
many tokens, a stop string cuts the text where vLLM's detokenizer cuts it, choice ``i`` of ``n`` is the
request seeded ``seed + i``.  Expected texts come from the transformers tokenizer of the bundle.
The penalties' arithmetic is checked against vLLM's formula written out here (``apply_penalties``,
``vllm/model_executor/layers/utils.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from mmgate.api.choice_text import check_stop_strings
from mmgate.request.parse import parse_chat_request
from mmgate.errors import GatewayError
from mmgate.refengine.sampler import apply_penalties, sample_next
from mmgate.refengine.sampling import GenerationPlan
from tests.abuse.support import Stack, bundle_path, chat_body, running_stack

HELLO, WORLD, DOT = "Hello", " world", "."


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(bundle_path())


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base}/v1", api_key="none", max_retries=0, timeout=60)


def one(tok: Any, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, text
    return int(ids[0])


def post(stack: Stack, **fields: Any) -> dict[str, Any]:
    r = httpx.post(f"{stack.base}/v1/chat/completions", json=chat_body(stack.model, **fields), timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def stream(stack: Stack, **fields: Any) -> list[dict[str, Any]]:
    body = chat_body(stack.model, stream=True, stream_options={"include_usage": True}, **fields)
    r = httpx.post(f"{stack.base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def streamed_texts(events: list[dict[str, Any]]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["delta"].get("content", "")
    return texts


def content(body: dict[str, Any], i: int = 0) -> str:
    return str(body["choices"][i]["message"]["content"])


# ---- refusals ---------------------------------------------------------------------------------------


def test_an_unknown_field_is_refused_by_name_never_dropped(stack: Stack, client: openai.OpenAI) -> None:
    r = httpx.post(f"{stack.base}/v1/chat/completions", json=chat_body(stack.model, frobnicate={"x": 1}), timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "frobnicate" and "frobnicate" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1, extra_body={"best_of": 2})
    assert info.value.body["param"] == "best_of"  # type: ignore[index]


@pytest.mark.parametrize("fields,param", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # vLLM: top_logprobs needs logprobs=true
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"n": 129}, "n"),
])
def test_out_of_range_sampling_fields_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as info:
        parse_chat_request(json.dumps(chat_body(**fields)).encode())
    assert (info.value.status, info.value.param) == (400, param)
    assert "abc" not in info.value.message and "100.5" not in info.value.message


@pytest.mark.parametrize("fields", [
    {"n": 128}, {"logprobs": True, "top_logprobs": 20}, {"logprobs": True, "top_logprobs": 0}, {"min_p": 0.0},
    {"min_p": 1.0}, {"repetition_penalty": 1e6}, {"min_tokens": 4, "max_tokens": 4},
    {"logit_bias": {"0": -100, "2147483647": 100}}, {"stop_token_ids": list(range(64))}, {"user": "u-1"},
    {"include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False},
], ids=lambda f: "-".join(f))
def test_sampling_fields_at_their_edges_are_accepted(fields: dict[str, Any]) -> None:
    parse_chat_request(json.dumps(chat_body(**fields)).encode())


def test_an_unknown_field_whose_name_is_not_an_identifier_is_not_echoed() -> None:
    with pytest.raises(GatewayError) as info:
        parse_chat_request(json.dumps(chat_body(**{"<b>x</b>": 1})).encode())
    assert info.value.status == 400 and info.value.param is None and "<b>" not in info.value.message


def test_a_token_id_outside_the_vocabulary_in_logit_bias_is_a_400(stack: Stack) -> None:
    r = httpx.post(f"{stack.base}/v1/chat/completions", json=chat_body(stack.model, logit_bias={"999999999": 1}),
                   timeout=30)
    assert r.status_code == 400


# ---- n --------------------------------------------------------------------------------------------------


def test_n_returns_n_choices_each_seeded_seed_plus_its_index(stack: Stack, client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Say one word."}]
    many = client.chat.completions.create(model=stack.model, messages=messages, n=3, max_tokens=4, temperature=1.0,
                                          seed=5, logprobs=True, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, choice in enumerate(many.choices):  # vLLM ParentRequest: child i is seeded seed + i
        single = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=4, temperature=1.0,
                                                seed=5 + i, extra_body={"ignore_eos": True})
        assert choice.message.content == single.choices[0].message.content
    assert len({c.message.content for c in many.choices}) > 1
    assert many.usage is not None and many.usage.completion_tokens == 3 * 4  # summed over the choices
    assert all(len(c.logprobs.content or []) == 4 for c in many.choices if c.logprobs is not None)


def test_n_streams_every_choice_with_its_index_and_one_finish_each(stack: Stack) -> None:
    fields = {"n": 3, "max_tokens": 4, "temperature": 1.0, "seed": 9, "ignore_eos": True}
    events = stream(stack, **fields)
    finishes = [c["index"] for e in events for c in e["choices"] if c["finish_reason"] is not None]
    assert sorted(finishes) == [0, 1, 2]
    whole = post(stack, **fields)
    assert streamed_texts(events) == {i: content(whole, i) for i in range(3)}
    assert events[-1]["usage"]["completion_tokens"] == 12 == whole["usage"]["completion_tokens"]


# ---- logprobs ------------------------------------------------------------------------------------


def test_logprobs_carry_the_sampled_token_and_the_top_k(stack: Stack, client: openai.OpenAI, tok: Any) -> None:
    out = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "Say one word."}],
                                         max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=5,
                                         extra_body={"ignore_eos": True})
    entries = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries is not None and len(entries) == 4
    for entry in entries:
        tops = entry.top_logprobs
        assert len(tops) == 5
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert sum(math.exp(t.logprob) for t in tops) <= 1.0 and all(t.logprob <= 0.0 for t in tops)
        # greedy, no processors: the sampled token is the most likely one (vLLM's raw logprobs)
        assert (entry.token, entry.logprob) == (tops[0].token, tops[0].logprob)
        assert entry.bytes == list(entry.token.encode("utf-8", errors="replace"))
    ids = [tok.convert_tokens_to_ids(tok.tokenize(e.token)) for e in entries]
    assert all(len(i) >= 1 for i in ids)
    streamed = stream(stack, max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=5, ignore_eos=True)
    chunks = [c["logprobs"]["content"] for e in streamed for c in e["choices"] if c.get("logprobs")]
    assert [x["logprob"] for chunk in chunks for x in chunk] == [e.logprob for e in entries]


def test_without_logprobs_none_are_returned(stack: Stack) -> None:
    assert post(stack, max_tokens=2)["choices"][0]["logprobs"] is None


# ---- logit_bias, min_tokens, stop ------------------------------------------------------------------


def test_a_logit_bias_of_100_forces_its_token(stack: Stack, tok: Any) -> None:
    hello = one(tok, HELLO)
    body = post(stack, max_tokens=3, temperature=0.0, logit_bias={str(hello): 100})
    assert content(body) == tok.decode([hello] * 3) == "HelloHelloHello"


def test_min_tokens_holds_the_stop_token_off_for_that_many_tokens(stack: Stack, tok: Any) -> None:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    forced = post(stack, max_tokens=8, temperature=0.0, logit_bias={str(eos): 100})
    assert (forced["usage"]["completion_tokens"], forced["choices"][0]["finish_reason"]) == (1, "stop")
    held = post(stack, max_tokens=8, temperature=0.0, logit_bias={str(eos): 100}, min_tokens=4)
    # vLLM MinTokensLogitsProcessor: stop ids masked while fewer than 4 tokens exist; the 5th is the eos
    assert (held["usage"]["completion_tokens"], held["choices"][0]["finish_reason"]) == (5, "stop")


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids_end_the_choice_and_its_text_is_left_out_unless_included(stack: Stack, tok: Any,
                                                                                 include: bool) -> None:
    dot = one(tok, DOT)
    fields = {"max_tokens": 6, "temperature": 0.0, "logit_bias": {str(dot): 100}, "stop_token_ids": [dot],
              "include_stop_str_in_output": include}
    body = post(stack, **fields)
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (1, "stop")
    assert content(body) == ("." if include else "")
    assert streamed_texts(stream(stack, **fields))[0] == content(body)


@pytest.mark.parametrize("stop,include,expected,tokens", [
    ("llo", False, "He", 1), ("llo", True, "Hello", 1),
    ("oH", False, "Hell", 2), ("oH", True, "HelloH", 2),  # across two tokens: HelloHello
])
def test_a_stop_string_cuts_the_text_as_vllm_does(stack: Stack, tok: Any, stop: str, include: bool, expected: str,
                                                  tokens: int) -> None:
    fields = {"max_tokens": 6, "temperature": 0.0, "logit_bias": {str(one(tok, HELLO)): 100}, "stop": [stop],
              "include_stop_str_in_output": include}
    body = post(stack, **fields)
    assert content(body) == expected
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (tokens, "stop")
    assert streamed_texts(stream(stack, **fields))[0] == expected


def test_skip_special_tokens_false_keeps_special_token_text(stack: Stack, tok: Any) -> None:
    vision = tok.convert_tokens_to_ids("<|vision_start|>")
    fields = {"max_tokens": 2, "temperature": 0.0, "logit_bias": {str(vision): 100}}
    assert content(post(stack, **fields)) == ""
    assert content(post(stack, skip_special_tokens=False, **fields)) == "<|vision_start|>" * 2


def test_max_completion_tokens_bounds_the_completion(stack: Stack) -> None:
    body = post(stack, max_completion_tokens=3, ignore_eos=True, temperature=0.0)
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (3, "length")


# ---- seed, min_p, penalties -------------------------------------------------------------------------


def test_a_seed_reproduces_a_sampled_completion(stack: Stack) -> None:
    fields = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    first, again = content(post(stack, seed=11, **fields)), content(post(stack, seed=11, **fields))
    assert first == again != content(post(stack, seed=12, **fields))


def test_min_p_of_one_keeps_only_the_most_likely_token(stack: Stack) -> None:
    greedy = content(post(stack, max_tokens=6, temperature=0.0, ignore_eos=True))
    assert content(post(stack, max_tokens=6, temperature=1.0, seed=3, min_p=1.0, ignore_eos=True)) == greedy
    assert content(post(stack, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)) != greedy


def test_repetition_penalty_discounts_tokens_of_the_prompt(stack: Stack, tok: Any) -> None:
    # "." is in the prompt ("Say one word."), "Hello" is not: biased 100 and 60, "." wins unless its
    # positive logit is divided by 2 (~50 < ~60)
    bias = {str(one(tok, DOT)): 100, str(one(tok, HELLO)): 60}
    assert content(post(stack, max_tokens=1, temperature=0.0, logit_bias=bias)) == "."
    assert content(post(stack, max_tokens=1, temperature=0.0, logit_bias=bias, repetition_penalty=2.0)) == HELLO


def test_frequency_penalty_grows_with_each_repeat(stack: Stack, tok: Any) -> None:
    # biased 100 and 90: "Hello" repeats, unless 2 per repeat is taken off it, then " world" wins
    bias = {str(one(tok, HELLO)): 100, str(one(tok, WORLD)): 90}
    fields = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logit_bias": bias}
    assert content(post(stack, **fields)) == HELLO * 12
    penalized = content(post(stack, frequency_penalty=2.0, **fields))
    assert penalized.startswith(HELLO * 3) and WORLD in penalized


def test_presence_penalty_takes_a_constant_off_seen_tokens(stack: Stack, tok: Any) -> None:
    # biased 100 and 99: "Hello" repeats; with 2 taken off every token already generated, " world"
    # overtakes "Hello" at the second token (the random weights' logits differ by less than 1 there)
    bias = {str(one(tok, HELLO)): 100, str(one(tok, WORLD)): 99}
    fields = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logit_bias": bias}
    assert content(post(stack, **fields)) == HELLO * 6
    assert content(post(stack, presence_penalty=2.0, **fields)).startswith(HELLO + WORLD)


# ---- the engine's arithmetic, against vLLM's formulas written out -------------------------------------


def _plan(**fields: Any) -> GenerationPlan:
    base: dict[str, Any] = {"max_new_tokens": 8, "min_new_tokens": 0, "do_sample": False, "temperature": 0.0,
                            "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "seed": None,
                            "stop_token_ids": (), "stop_strings": ()}
    return GenerationPlan(**{**base, **fields})


def test_penalties_follow_vllms_apply_penalties() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    prompt, output = torch.tensor([0, 1]), [2, 2, 3]
    got = apply_penalties(logits.clone(), prompt, output, repetition=2.0, frequency=0.5, presence=0.25)
    # vLLM: seen (prompt or output) -> positive / 2, non-positive * 2; then - 0.5 * count - 0.25 * (count > 0)
    expected = torch.tensor([[2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 2 - 0.25, -3.0 * 2 - 0.5 - 0.25, 1.0]])
    assert torch.equal(got, expected)


def test_min_tokens_and_logit_bias_act_before_the_penalties_and_logprobs_are_raw() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    raw = torch.log_softmax(logits, dim=-1)
    plan = _plan(min_new_tokens=2, stop_token_ids=(1,), logit_bias=((3, 2.5),), logprobs=2)
    token, lp = sample_next(plan, logits.clone(), torch.tensor([0]), [], None)
    assert token == 3  # 1 is masked (-inf), 3 has 0 + 2.5 > 2.0
    assert lp is not None and lp.token_id == 3 and lp.logprob == pytest.approx(float(raw[0, 3]))
    assert lp.top_ids == (1, 2)  # the raw logits' top 2, before any processor (logprobs_mode=raw_logprobs)
    assert sample_next(plan, logits.clone(), torch.tensor([0]), [5, 6], None)[0] == 1  # min_tokens reached


def test_stop_strings_are_searched_in_the_new_text_only() -> None:
    assert check_stop_strings("Hello", 5, ("llo",), False) == ("llo", 2)
    assert check_stop_strings("Hello", 5, ("llo",), True) == ("llo", -1)
    assert check_stop_strings("HelloHe", 2, ("oH",), True) == ("oH", 6)
    assert check_stop_strings("Hello world", 6, ("He",), False) is None  # before the new text

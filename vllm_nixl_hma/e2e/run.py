"""One ``e2e`` run: a reference engine, then a prefill and a decode engine behind
the P/D router, the same prompts through both, token by token.

The reference engine (no connector, TP 1) answers every prompt first and is
stopped; then prefill (TP ``p_tp``) and decode (TP ``d_tp``) start with the
chosen connector, and every prompt goes through ``vllm_nixl_hma.proxy`` as a
P/D proxy routes it: prefill with ``max_tokens=1`` and ``do_remote_decode``,
then decode with the ``kv_transfer_params`` prefill returned. Greedy decoding
with ``ignore_eos``: decode's tokens must equal the reference's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_nixl_hma.e2e import conversation, routers
from vllm_nixl_hma.e2e.servers import (
    MAX_MODEL_LEN,
    EngineSpec,
    EngineStartError,
    HTTPResult,
    ServerSet,
    post_json,
    post_stream,
)

__all__ = ["E2EOptions", "PromptResult", "run_e2e"]

#: bad queries thrown at prefill's side channel before the P/D prompts (ours only)
SIDE_CHANNEL_BARRAGE_FRAMES = 1000
#: the environment variable e2e hands our engines their ticket key in
TICKET_KEYS_ENV = "VLLM_NIXL_HMA_E2E_TICKET_KEYS"

MAX_TOKENS = 8
#: what every engine is started with under ``--prefix-caching``
PREFIX_CACHING_ARGS = ("--enable-prefix-caching", "--mamba-cache-mode", "align")
#: and under ``--no-prefix-caching``
NO_PREFIX_CACHING_ARGS = ("--no-enable-prefix-caching",)
#: the prompt every fault is injected into: several logical blocks on both sides
FAULT_PROMPT_TOKENS = 600


def fault_prompt_tokens(name: str) -> int:
    """Each fault's own prompt length (``FAULT_PROMPT_TOKENS`` and up): a
    decode engine with prefix caching (vLLM's default for a dense model)
    must not find the previous fault's prompt cached and read less."""
    from vllm_nixl_hma.e2e.faults import ALL_FAULTS

    return FAULT_PROMPT_TOKENS + 7 * ALL_FAULTS.index(name)


KERNEL_BLOCK_TOKENS = 16
#: how long ours waits for each side-channel answer in e2e (``side_channel_timeout_s``)
E2E_SIDE_CHANNEL_TIMEOUT_S = 15.0
#: how long ours lets a read stay in flight in e2e (``read_timeout_s``): a vanished
#: prefill host's read is given up well inside the request timeout
E2E_READ_TIMEOUT_S = 20.0
#: how long ours lets each engine worker's NIXL progress thread wait between
#: polls in e2e (``progress_thread_delay_us``; NIXL rounds it up to 1 ms)
E2E_PROGRESS_THREAD_DELAY_US = 1000
#: the chat prompt's length in tokens (the tiny models' tokenizer has a word per token)
CHAT_PROMPT_TOKENS = 300
#: the embedded models ship no chat template: the messages' text, as it is
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@dataclass
class E2EOptions:
    model: str = "hybrid"  # an embedded model name, or a directory
    connector: str = "NixlHMAConnector"
    p_tp: int = 2
    d_tp: int = 1
    kernel_block_tokens: int | None = KERNEL_BLOCK_TOKENS
    #: what the engines' CPU fused-MoE layer is told about AMX (``cpu_moe.CHOICES``)
    cpu_amx: str = "host"
    start_timeout_s: float = 900.0
    request_timeout_s: float = 300.0
    #: names from ``faults.ALL_FAULTS`` to inject, in its order (``NETWORK_FAULTS``
    #: need ``separate_hosts``)
    faults: tuple[str, ...] = ()
    #: every engine and the router on a host of its own (``netns``), on links of ``link_rate``
    separate_hosts: bool = False
    link_rate: str = "10gbit"
    #: prefill and decode engines behind the router (xPyD); each pair is routed in turn
    prefills: int = 1
    decodes: int = 1
    #: data-parallel ranks of each decode engine (each TP ``d_tp``)
    decode_dp: int = 1
    #: the P/D router: ``proxy`` (this package's) or ``vllm-router`` (vLLM's)
    router: str = "proxy"
    #: after the prompts, send decode one ``other-request-ticket`` request
    #: (``faults``) and report what it answered (``forged_read``): how stock,
    #: which has no tickets, reads another request's blocks
    forged_read_probe: bool = False
    #: every engine keeps prefix caching (the reference too), and a multi-turn
    #: conversation follows the prompts (``e2e.conversation``)
    prefix_caching: bool = False
    #: every engine runs without prefix caching (``--no-enable-prefix-caching``;
    #: vLLM's default keeps it for a model without Mamba layers)
    no_prefix_caching: bool = False


@dataclass
class PromptResult:
    prompt_tokens: int
    generated: list[int] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)
    matching_prefix: int = 0
    match: bool = False
    http_status: int = 0
    error: str | None = None
    concurrent: bool = False
    max_logprob_diff: float | None = None
    api: str = "completions"  # or "chat", "chat-stream": /v1/chat/completions, whole or streamed
    #: the engines the router sent it to (names, from its answer's headers)
    prefill: str | None = None
    decode: str | None = None
    #: why the answer stopped (``length`` when all ``MAX_TOKENS`` came)
    finish_reason: str | None = None
    #: wall-clock seconds the request went out and its answer ended (what
    #: engine log lines are matched against when it failed)
    sent_at: float = 0.0
    answered_at: float = 0.0

    def as_json(self) -> dict[str, Any]:
        row = asdict(self)
        row.pop("reference")
        return row


def prompt_ids(length: int) -> list[int]:
    """Token ids of a prompt of ``length`` tokens (fixed per length)."""
    from vllm_nixl_hma.e2e.models import VOCAB_SIZE

    rng = random.Random(length)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]


def prompt_lengths(prefill_block: int, decode_block: int) -> tuple[list[int], list[int]]:
    """(sequential, concurrent) prompt lengths: inside one logical block, across
    several, exactly on a boundary of both sides; then a concurrent batch."""
    larger, smaller = max(prefill_block, decode_block), min(prefill_block, decode_block)
    boundary = math.lcm(prefill_block, decode_block)
    sequential = [smaller // 2 + 3, 3 * larger + 17, boundary, larger + smaller // 2 + 5]
    concurrent = [larger // 3 + 1, 2 * larger + 7, boundary + 9]
    longest = MAX_MODEL_LEN - MAX_TOKENS
    if max(sequential + concurrent) > longest:
        raise ValueError(
            f"logical blocks of {prefill_block} and {decode_block} tokens need prompts "
            f"longer than max_model_len {MAX_MODEL_LEN} allows"
        )
    return sequential, concurrent


def completion(ids: list[int]) -> dict[str, Any]:
    return {
        "model": "model",
        "prompt": ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
    }


def chat(ids: list[int], stream: bool = False) -> dict[str, Any]:
    """A chat request whose text tokenizes to ``ids`` (one word per token)."""
    body = {
        "model": "model",
        "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in ids)}],
        "chat_template": CHAT_TEMPLATE,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "return_token_ids": True,
    }
    if stream:
        body["stream"] = True
    return body


def _tokens(result: HTTPResult) -> tuple[list[int], list[float]]:
    """Generated token ids and their logprobs, from a completion, a chat
    completion, or the chunks of a streamed one."""
    body = result.body or {}
    choices = [c["choices"][0] for c in body.get("chunks", []) if c.get("choices")]
    if not choices:
        choices = body.get("choices", [{}])[:1]
    tokens: list[int] = []
    logprobs: list[float] = []
    for choice in choices:
        tokens += choice.get("token_ids") or []
        given = choice.get("logprobs") or {}
        logprobs += given.get("token_logprobs") or [
            c["logprob"] for c in given.get("content") or []
        ]
    return tokens, logprobs


def _finish_reason(result: HTTPResult) -> str | None:
    """The last ``finish_reason`` in a completion or a stream's chunks."""
    body = result.body or {}
    reasons = [
        choice.get("finish_reason")
        for chunk in body.get("chunks", [body])
        for choice in chunk.get("choices") or []
    ]
    return next((r for r in reversed(reasons) if r), None)


def _error_in_answer(result: HTTPResult) -> str | None:
    """What an answer says went wrong although its status was 200: a body that
    is not a JSON object, an ``error`` object, or an error event in a stream."""
    if result.body is None:
        return result.error or "the answer is not a JSON object"
    errors = [c["error"] for c in result.body.get("chunks", [result.body]) if c.get("error")]
    return json.dumps(errors[0])[:500] if errors else None


#: ``separate_hosts``: the host each engine runs on (the router and this
#: driver's requests run on ``ROUTER_HOST``)
HOST_OF_ENGINE = {
    "reference": "ref",
    "prefill": "prefill",
    "decode": "decode",
    "decode-recompute": "decoderc",
}
ROUTER_HOST = "router"


def engine_names(role: str, count: int) -> list[str]:
    """The names of ``count`` engines of ``role``: ``prefill``, ``prefill-1``, ..."""
    return [role] + [f"{role}-{k}" for k in range(1, count)]


def host_of(name: str) -> str:
    """The host engine ``name`` runs on with ``separate_hosts`` (``prefill-1``: ``prefill1``)."""
    return HOST_OF_ENGINE.get(name) or name.replace("-", "")


@dataclass(frozen=True)
class Placement:
    """Where engines and the router run: all on 127.0.0.1 in this network
    namespace, or each on a host of ``topology`` (``netns.Topology``)."""

    topology: Any = None

    def engine(self, name: str) -> dict[str, Any]:
        """``EngineSpec`` fields that put engine ``name`` on its host."""
        if self.topology is None:
            return {"host": "127.0.0.1", "namespace": None}
        host = self.topology.hosts[host_of(name)]
        # HTTP and the side channel on the control network; UCX on eth0, the data one
        return {"host": host.control_address, "namespace": host.namespace}

    @property
    def router_address(self) -> str:
        if self.topology is None:
            return "127.0.0.1"
        return self.topology.hosts[ROUTER_HOST].control_address

    @property
    def router_namespace(self) -> str | None:
        if self.topology is None:
            return None
        return self.topology.hosts[ROUTER_HOST].namespace


def run_e2e(
    options: E2EOptions, workdir: Path, progress: Callable[[str], None], verbose: bool = False
) -> dict[str, Any]:
    from vllm_nixl_hma.e2e import netns
    from vllm_nixl_hma.e2e.models import MODELS, ensure_model

    model_dir = (
        str(ensure_model(options.model)) if options.model in MODELS else str(Path(options.model))
    )
    report: dict[str, Any] = {
        "ok": False,
        "model": options.model,
        "connector": options.connector,
        "p_tp": options.p_tp,
        "d_tp": options.d_tp,
        "decode_dp": options.decode_dp,
        "local_ratio": None,
        "remote_ratio": None,
        "prompts": [],
        "faults": [],
        "cpu": {**_host_cpu(), "amx_told": options.cpu_amx, "moe_paths": {}},
        "start_failure": None,
        "separate_hosts": options.separate_hosts,
        "engines": [],
        "pairs": [],
        "kv_reads": {},
        "router": options.router,
        "logs": str(workdir),
    }
    try:
        routers.require_installed(options.router)
    except routers.RouterUnavailable as e:
        report["start_failure"] = {"engine": "router", "last_error": str(e)}
        report["error"] = str(e)
        progress(f"failed: {e}")
        return report
    engine = dict(
        model_dir=model_dir,
        kernel_block_tokens=options.kernel_block_tokens,
        cpu_amx=options.cpu_amx,
    )
    engines = []
    with contextlib.ExitStack() as stack:
        placement = Placement()
        if options.separate_hosts:
            try:
                topology = stack.enter_context(
                    netns.Topology(
                        [
                            ROUTER_HOST,
                            *HOST_OF_ENGINE.values(),
                            *(
                                host_of(name)
                                for role, count in (
                                    ("prefill", options.prefills),
                                    ("decode", options.decodes),
                                )
                                for name in engine_names(role, count)[1:]
                            ),
                        ],
                        link_rate=options.link_rate,
                    )
                )
            except (netns.NetworkNamespacesUnavailable, ValueError) as e:
                report["start_failure"] = {"engine": None, "last_error": str(e)}
                report["error"] = str(e)
                progress(f"failed: {e}")
                return report
            placement = Placement(topology)
            report["hosts"] = {
                name: {
                    "namespace": host.namespace,
                    "address": host.control_address,
                    "data_address": host.address,
                }
                for name, host in topology.hosts.items()
            }
            report["link"] = {"rate": options.link_rate, "rate_bits": topology.link_rate_bits}
            progress(
                f"hosts on {options.link_rate} links (control network, data network): "
                + ", ".join(
                    f"{n} {h.control_address} {h.address}" for n, h in topology.hosts.items()
                )
            )
            # this thread (its HTTP requests, the router it starts) on the router's host
            stack.enter_context(netns.entered(topology.hosts[ROUTER_HOST].namespace))
        servers = stack.enter_context(ServerSet(workdir))
        stack.enter_context(_follow(workdir, verbose))
        try:
            return _run_engines(options, report, servers, engines, engine, progress, placement)
        except EngineStartError as e:
            report["start_failure"] = e.as_json()
            report["error"] = str(e)
            progress(f"failed: {e}")
            return report
        finally:
            report["cpu"]["moe_paths"] = {
                server.name: paths for server in engines if (paths := server.cpu_moe_paths())
            }


def _host_cpu() -> dict[str, bool | None]:
    """What decides this host's fused-MoE path (None each without vLLM here)."""
    try:
        from vllm_nixl_hma.e2e import cpu_moe

        return {
            "host_amx": cpu_moe.host_has_amx(),
            "host_grouped_gemm_kernels": cpu_moe.host_has_grouped_gemm_kernels(),
        }
    except ImportError:
        return {"host_amx": None, "host_grouped_gemm_kernels": None}


def _run_engines(
    options, report, servers, engines, engine, progress, placement: Placement
) -> dict[str, Any]:
    """The reference, prefill and decode engines, the prompts and the faults;
    every engine started is appended to ``engines``."""
    from vllm_nixl_hma.core import tickets
    from vllm_nixl_hma.e2e import faults
    from vllm_nixl_hma.harness.coordinator import free_port

    ticket_key_line = f"e2e {secrets.token_hex(32)}"
    # prefix caching: vLLM 0.21.0 leaves it off for hybrids unless asked for
    caching_args = PREFIX_CACHING_ARGS if options.prefix_caching else ()
    if options.no_prefix_caching:
        if options.prefix_caching:
            raise ValueError("prefix_caching and no_prefix_caching exclude each other")
        caching_args = NO_PREFIX_CACHING_ARGS
    # 1. the reference: one engine, no connector
    progress("starting the reference engine (TP 1, no connector)")
    reference = servers.start_engine(
        EngineSpec(
            "reference",
            port=free_port(),
            extra_args=caching_args,
            **engine,
            **placement.engine("reference"),
        )
    )
    engines.append(reference)
    reference.wait_ready(options.start_timeout_s)
    # 2. prefill and decode
    specs = [
        EngineSpec(
            role,
            port=free_port(),
            tp_size=tp,
            connector=options.connector,
            side_channel_port=free_port(),
            extra_args=caching_args,
            **engine,
            **placement.engine(role),
        )
        for role, tp in (("prefill", options.p_tp), ("decode", options.d_tp))
    ]
    if options.decode_dp > 1:
        specs[1] = dataclasses.replace(specs[1], dp_size=options.decode_dp, dp_rpc_port=free_port())
    if options.connector == "NixlHMAConnector":
        # Several CPU engines share this host's cores: a prefill engine busy
        # with its first steps has left its side channel unanswered for more
        # than 5 s (upstream's fixed wait) on a first handshake, and decode
        # then fails the request, correctly but for the host's sake. Ours
        # takes a longer wait from kv_connector_extra_config; stock cannot.
        # And each engine worker's NIXL progress thread polls without pause
        # unless told to wait: with seven engines on 2 cores those threads
        # starved the side channel past even 15 s (core/progress_thread.py).
        # And tickets, as an operator should run ours: a key made for this run,
        # handed over in the environment (never on a command line or in a log)
        specs = [
            dataclasses.replace(
                spec,
                extra_config={
                    **spec.extra_config,
                    "side_channel_timeout_s": E2E_SIDE_CHANNEL_TIMEOUT_S,
                    "read_timeout_s": E2E_READ_TIMEOUT_S,
                    "progress_thread_delay_us": E2E_PROGRESS_THREAD_DELAY_US,
                    "ticket_keys_env": TICKET_KEYS_ENV,
                    # one JSON line per request (#27): checked against /metrics
                    "transfer_records": True,
                },
                extra_env={**spec.extra_env, TICKET_KEYS_ENV: ticket_key_line},
            )
            for spec in specs
        ]
        ticket_keys = tickets.parse_keys(ticket_key_line, "e2e's key")
    else:
        ticket_keys = None
    results: list[PromptResult] = []
    progress(
        f"starting prefill (TP {options.p_tp}) and decode (TP {options.d_tp}) with "
        f"{options.connector}"
    )
    if options.faults:  # a second decode engine, which recomputes what did not arrive
        specs.append(
            dataclasses.replace(
                specs[1],
                name="decode-recompute",
                port=free_port(),
                side_channel_port=free_port(),
                kv_load_failure_policy="recompute",
                dp_rpc_port=free_port() if options.decode_dp > 1 else None,
                **placement.engine("decode-recompute"),
            )
        )
    # xPyD: the other prefill and decode engines, configured as the first of each
    for role, count, first in (
        ("prefill", options.prefills, specs[0]),
        ("decode", options.decodes, specs[1]),
    ):
        specs += [
            dataclasses.replace(
                first,
                name=name,
                port=free_port(),
                side_channel_port=free_port(),
                dp_rpc_port=free_port() if first.dp_size > 1 else None,
                **placement.engine(name),
            )
            for name in engine_names(role, count)[1:]
        ]
    started = [servers.start_engine(spec) for spec in specs]
    engines.extend(started)
    prefill, decode = started[:2]
    prefills = [prefill] + [s for s in started if s.name.startswith("prefill-")]
    decodes = [decode] + [s for s in started if re.fullmatch(r"decode-\d+", s.name)]
    report["engines"] = [
        {"name": s.name, "role": role, "url": s.url, "tp": tp}
        for role, group, tp in (
            ("prefill", prefills, options.p_tp),
            ("decode", decodes, options.d_tp),
        )
        for s in group
    ]
    try:
        for server in started:
            server.wait_ready(options.start_timeout_s)
    except TimeoutError as e:
        report["error"] = f"{e}; see {report['logs']}"
        progress(f"failed: {e}")
        return report
    (prefill_block, prefill_kernel), (decode_block, decode_kernel) = (
        prefill.block_tokens(),
        decode.block_tokens(),
    )
    if None in (prefill_block, prefill_kernel, decode_block, decode_kernel):
        report["error"] = "an engine did not report its block size (log or /metrics)"
        return report
    report["remote_ratio"] = prefill_block // prefill_kernel
    report["local_ratio"] = decode_block // decode_kernel
    try:
        lengths = prompt_lengths(prefill_block, decode_block)
    except ValueError as e:
        report["error"] = str(e)
        return report
    progress(
        f"logical blocks: prefill {prefill_block} tokens (ratio {report['remote_ratio']}), "
        f"decode {decode_block} tokens (ratio {report['local_ratio']}); prompts "
        f"{lengths[0]}, then {lengths[1]} concurrently"
    )
    pairs = len(prefills) * len(decodes)
    if pairs > 1:  # the concurrent batch meets every pair twice
        lengths = (lengths[0], concurrent_lengths(lengths[1], 2 * pairs))
    # after the faults (prefill killed last), the same pairs again: new prompts
    survivors = "prefill-killed" in options.faults and len(prefills) > 1
    after_lengths = [n + 1 for n in lengths[1]] if survivors else []
    forged = "other-request-ticket"
    # the forged request's own prompt, and its victim's (``faults.forged_params``)
    forged_lengths = (
        [fault_prompt_tokens(forged), faults.victim_prompt_tokens(fault_prompt_tokens(forged))]
        if forged in options.faults or options.forged_read_probe
        else []
    )
    all_lengths = sorted(
        {
            *lengths[0],
            *lengths[1],
            *after_lengths,
            *(fault_prompt_tokens(f) for f in options.faults),
            *forged_lengths,
        }
    )
    progress(f"reference answers {len(all_lengths) + 1} prompts")
    expected = {
        n: post_json(
            reference.url,
            "/v1/completions",
            completion(prompt_ids(n)),
            options.request_timeout_s,
        )
        for n in all_lengths
    }
    expected_chat = post_json(
        reference.url,
        "/v1/chat/completions",
        chat(prompt_ids(CHAT_PROMPT_TOKENS)),
        options.request_timeout_s,
    )
    turns_expected: list[tuple[list[int], Any]] = []
    control_expected = None
    if options.prefix_caching:
        try:
            turns_expected, control_expected = _reference_conversation(
                reference, decode_block, options, progress
            )
        except ValueError as e:
            report["error"] = str(e)
            return report
    servers.stop(reference)
    if options.connector == "NixlHMAConnector":
        # #25: prefill's side channel takes a barrage of bad queries from raw
        # ZMQ clients, then must answer every rank, and the P/D prompts below
        # (decode's first handshake) must go through it
        progress(f"{SIDE_CHANNEL_BARRAGE_FRAMES} bad queries at prefill's side channel")
        report["side_channel_barrage"] = _side_channel_barrage(specs[0], options.p_tp)
    router = _start_router(prefills, decodes, options, placement, servers)
    router_url = router.url
    link_before = _link_counters(placement)
    kv_before = _kv_bytes_read(decode)
    reads_before = {d.name: sum(kv_reads_by_dp_rank(d).values()) for d in decodes}
    try:
        for n in lengths[0]:
            progress(f"P/D prompt of {n} tokens")
            results.append(_compare(n, expected[n], _pd(router_url, n, options), concurrent=False))
        progress(f"P/D prompts of {lengths[1]} tokens, concurrently")
        with ThreadPoolExecutor(len(lengths[1])) as pool:
            answers = list(pool.map(lambda n: _pd(router_url, n, options), lengths[1]))
        for n, answer in zip(lengths[1], answers, strict=True):
            results.append(_compare(n, expected[n], answer, concurrent=True))
        n = CHAT_PROMPT_TOKENS
        progress(f"P/D chat prompt of {n} tokens, whole and streamed")
        body = chat(prompt_ids(n))
        answer = post_json(router_url, "/v1/chat/completions", body, options.request_timeout_s)
        results.append(_compare(n, expected_chat, answer, concurrent=False, api="chat"))
        answer = post_stream(
            router_url,
            "/v1/chat/completions",
            {**body, "stream": True},
            options.request_timeout_s,
        )
        results.append(_compare(n, expected_chat, answer, concurrent=False, api="chat-stream"))
        if options.prefix_caching:
            turns, control = _conversation(
                router_url,
                prefills,
                decode,
                decode_block,
                turns_expected,
                control_expected,
                options,
                progress,
            )
            report["turns"] = [t.as_json() for t in turns]
            report["turns_control"] = control.as_json()
            report["conversation_ok"] = conversation.conversation_ok(turns, control)
    finally:
        router.stop()
    if placement.topology is not None:
        report["link"].update(
            _link_report(link_before, _link_counters(placement), kv_before, decode)
        )
    # a router may send decode a request without prefill's kv_transfer_params
    # (vllm-router does when prefill returned none): decode then computes the
    # prompt itself and matches; each decode engine must have read KV
    report["kv_reads"] = {
        d.name: sum(kv_reads_by_dp_rank(d).values()) - reads_before[d.name] for d in decodes
    }
    if options.decode_dp > 1:
        # which DP ranks read: vLLM labels each rank's NIXL metrics with its engine index
        report["decode_dp_reads"] = {server.name: kv_reads_by_dp_rank(server) for server in decodes}
    if options.faults:
        decode_by_policy = {"fail": decode, "recompute": started[2]}
        spec_of = {"fail": specs[1], "recompute": specs[2]}

        def start_again(policy: str):
            """A decode engine a fault cell took down, started again (stock's
            died on a refused handshake), so that later cells meet an engine."""
            dead = decode_by_policy[policy]
            servers.stop(dead)
            engines.remove(dead)
            server = servers.start_engine(spec_of[policy])
            engines.append(server)
            server.wait_ready(options.start_timeout_s)
            started[started.index(dead)] = server
            return server

        report["faults"] = [
            f.as_json()
            for f in _faults(
                prefill,
                decode_by_policy,
                expected,
                options,
                progress,
                placement,
                ticket_keys,
                start_again,
            )
        ]
        decode = decode_by_policy["fail"]
    if options.forged_read_probe:
        progress("a forged ticket: this prompt's params with another request's block ids")
        report["forged_read"] = _ticket_cells(
            "other-request-ticket", prefill, {"fail": decode}, expected, options, placement
        )[0].as_json()
    if options.connector == "NixlHMAConnector":
        progress("the plugin's counters on each engine's /metrics, against its log's records")
        report.update(_plugin_metrics(started))
    after: list[PromptResult] = []
    if survivors:
        progress(f"after the faults, {prefill.name} is gone: P/D prompts of {after_lengths} tokens")
        router = _start_router(prefills, decodes, options, placement, servers)
        try:
            after = [
                _compare(n, expected[n], _pd(router.url, n, options), concurrent=False)
                for n in after_lengths
            ]
        finally:
            router.stop()
    name_of = {server.url: server.name for server in started}
    for result in results + after:  # the router names engines by URL
        result.prefill = name_of.get(result.prefill, result.prefill)
        result.decode = name_of.get(result.decode, result.decode)
    report["prompts"] = [r.as_json() for r in results]
    report["pairs"] = pair_counts(prefills, decodes, results)
    report["after_faults"] = [r.as_json() for r in after]
    barrage_report = report.get("side_channel_barrage")
    report["ok"] = (
        (barrage_report is None or all(barrage_report["ranks_answered_after"]))
        and every_dp_rank_read(report.get("decode_dp_reads"), options.decode_dp)
        and bool(results)
        and all(r.match and r.http_status == 200 for r in results)
        and all(f["ok"] for f in report["faults"])
        and all(pair["matched"] > 0 for pair in report["pairs"])
        and all(reads > 0 for reads in report["kv_reads"].values())
        and survivors_served(after, gone=prefill.name)
        and (not options.prefix_caching or report.get("conversation_ok") is True)
        and report.get("records_match", True) is True
    )
    return report


def _reference_conversation(reference, decode_block: int, options, progress):
    """The conversation's prompts, each with the reference's answer, and the
    control prompt (as long as the last turn, of tokens nothing else sends)
    with its answer. ValueError when two turns do not fit."""
    from vllm_nixl_hma.e2e.models import VOCAB_SIZE

    lengths = conversation.turn_message_lengths(
        decode_block, MAX_TOKENS, MAX_MODEL_LEN - MAX_TOKENS
    )
    progress(f"the reference answers a conversation of {len(lengths)} turns")

    def answer(ids: list[int]):
        body = completion(ids)
        return post_json(reference.url, "/v1/completions", body, options.request_timeout_s)

    turns: list[tuple[list[int], Any]] = []
    ids: list[int] = []
    for number, length in enumerate(lengths, start=1):
        answer_ids = _tokens(turns[-1][1])[0] if turns else []
        ids = ids + answer_ids + conversation.message_ids(str(number), length, VOCAB_SIZE)
        turns.append((ids, answer(ids)))
    control_ids = conversation.message_ids("control", len(ids), VOCAB_SIZE)
    control = (control_ids, answer(control_ids))
    return turns, control


def _conversation(
    router_url, prefills, decode, decode_block, turns_expected, control_expected, options, progress
):
    """Each turn through the router, then the control prompt, with what each
    cost on the engines' /metrics."""
    from vllm_nixl_hma.e2e.conversation import Turn, counter

    def metrics(server) -> str:
        try:
            status, text = server.get("/metrics")
        except OSError:
            return ""
        return text if status == 200 else ""

    def totals() -> dict[str, float]:
        decode_text = metrics(decode)
        return {
            "prefill_hits": sum(counter(metrics(p), "vllm:prefix_cache_hits") for p in prefills),
            "decode_hits": counter(decode_text, "vllm:prefix_cache_hits"),
            "decode_external": counter(decode_text, "vllm:external_prefix_cache_hits"),
        }

    rows = []
    for number, (ids, expected) in enumerate([*turns_expected, control_expected], start=1):
        is_control = number > len(turns_expected)
        progress("P/D control prompt" if is_control else f"P/D conversation turn {number}")
        before, bytes_before = totals(), _kv_bytes_read(decode)
        body = completion(ids)
        answer = post_json(router_url, "/v1/completions", body, options.request_timeout_s)
        after, bytes_after = totals(), _kv_bytes_read(decode)
        compared = _compare(len(ids), expected, answer, concurrent=False)
        row = Turn(
            turn=0 if is_control else number,
            prompt_tokens=len(ids),
            match=compared.match,
            http_status=answer.status,
            error=compared.error,
            prefill_prefix_hit_tokens=int(after["prefill_hits"] - before["prefill_hits"]),
            decode_prefix_hit_tokens=int(after["decode_hits"] - before["decode_hits"]),
            decode_external_tokens=int(after["decode_external"] - before["decode_external"]),
            decode_kv_bytes_read=None
            if bytes_before is None or bytes_after is None
            else bytes_after - bytes_before,
        )
        row.record_reads(decode_block)
        rows.append(row)
    return rows[:-1], rows[-1]


def _side_channel_barrage(prefill_spec, p_tp: int) -> dict[str, Any]:
    """``e2e.barrage`` at the first prefill engine's side channel, then one
    real query per prefill rank: what was sent, and which ranks answered."""
    from vllm_nixl_hma.e2e import barrage

    host, port = prefill_spec.host, prefill_spec.side_channel_port
    sent = barrage.barrage(host, port, frames=SIDE_CHANNEL_BARRAGE_FRAMES)
    answered = [
        barrage.handshake_ok(host, port, tp_rank=rank, timeout_s=15.0) for rank in range(p_tp)
    ]
    return {"sent": sent, "ranks_answered_after": answered}


def _start_router(prefills, decodes, options, placement, servers) -> routers.StartedRouter:
    """The router ``options.router`` over every engine, on the router's host."""
    return routers.start_router(
        options.router,
        [p.url for p in prefills],
        [d.url for d in decodes],
        placement.router_address,
        options.request_timeout_s,
        servers,
        namespace=placement.router_namespace,
    )


def survivors_served(after: list[PromptResult], gone: str) -> bool:
    """After prefill engine ``gone`` was killed: every prompt routed to it
    answered an error, every other one the reference's tokens, and both kinds
    happened (an empty round proves nothing; vllm-router, started after the
    kill, still sends the dead engine its turn)."""
    if not after:
        return True
    to_gone = [r for r in after if r.prefill == gone]
    to_others = [r for r in after if r.prefill != gone]
    return (
        bool(to_gone and to_others)
        and all(r.http_status != 200 for r in to_gone)
        and all(r.http_status == 200 and r.match for r in to_others)
    )


def concurrent_lengths(lengths: list[int], count: int) -> list[int]:
    """``count`` prompt lengths for the concurrent batch: ``lengths``, then each
    of them again a few tokens longer (distinct prompts: no prefix-cache hit
    on a dense decode engine makes it read less)."""
    return [lengths[i % len(lengths)] + 3 * (i // len(lengths)) for i in range(count)]


def pair_counts(prefills, decodes, results: list[PromptResult]) -> list[dict[str, Any]]:
    """Per (prefill, decode) pair: the P/D prompts the router sent it and how
    many of them matched the reference (decode's KV came from that prefill
    engine: under ``fail`` a read that did not happen is an error answer)."""
    rows = []
    for prefill in prefills:
        for decode in decodes:
            served = [r for r in results if (r.prefill, r.decode) == (prefill.name, decode.name)]
            rows.append(
                {
                    "prefill": prefill.name,
                    "decode": decode.name,
                    "routed": len(served),
                    "matched": sum(r.match for r in served),
                }
            )
    return rows


def _link_counters(placement: Placement) -> dict[str, dict[str, int]]:
    """Bytes each host's interface sent and received so far ({} on one host)."""
    if placement.topology is None:
        return {}
    return {name: placement.topology.counters(name) for name in placement.topology.hosts}


#: one sample line of vLLM's NIXL bytes histogram on /metrics (labels vary by release)
_NIXL_BYTES = re.compile(r"^vllm:nixl_bytes_transferred_sum(?:\{[^}]*\})?\s+(\S+)$", re.M)


#: one sample of vLLM's NIXL transfer count, labelled with the engine (DP rank) index
_NIXL_TRANSFERS = re.compile(
    r'^vllm:nixl_xfer_time_seconds_count\{[^}]*engine="(\d+)"[^}]*\}\s+(\S+)$', re.M
)


def kv_reads_by_dp_rank(decode) -> dict[str, int]:
    """NIXL transfers each DP rank of ``decode`` finished so far, from its
    /metrics (vLLM's ``vllm:nixl_xfer_time_seconds`` histogram, per
    ``engine`` label); {} when the metric is not there."""
    try:
        status, text = decode.get("/metrics")
    except OSError:
        return {}
    reads: dict[str, int] = {}
    for engine, count in _NIXL_TRANSFERS.findall(text) if status == 200 else []:
        reads[engine] = reads.get(engine, 0) + int(float(count))
    return reads


def every_dp_rank_read(reads_by_engine: dict[str, dict[str, int]] | None, dp_size: int) -> bool:
    """With data-parallel decode: every rank of every decode engine read KV."""
    if dp_size <= 1:
        return True
    return bool(reads_by_engine) and all(
        all(reads.get(str(rank), 0) > 0 for rank in range(dp_size))
        for reads in reads_by_engine.values()
    )


def _kv_bytes_read(decode) -> int | None:
    """What decode's NIXL reads moved so far, in bytes: vLLM's own histogram
    (``vllm:nixl_bytes_transferred``, from NIXL's transfer telemetry) summed
    over its label sets; None when the metric is not there."""
    try:
        status, text = decode.get("/metrics")
    except OSError:
        return None
    found = _NIXL_BYTES.findall(text) if status == 200 else []
    return int(sum(float(value) for value in found)) if found else None


def _link_report(before, after, kv_before, decode) -> dict[str, Any]:
    """The link counters' growth per host over the P/D prompts, and the KV
    bytes decode's NIXL read meanwhile."""
    grown = {
        name: {
            direction: after[name][direction] - before[name][direction]
            for direction in ("tx_bytes", "rx_bytes")
        }
        for name in after
    }
    kv_after = _kv_bytes_read(decode)
    kv = None if kv_after is None else kv_after - (kv_before or 0)
    return {"bytes_during_prompts": grown, "kv_bytes_read": kv}


def _faults(
    prefill, decode_by_policy, expected, options, progress, placement: Placement, ticket_keys,
    start_again=None,
):  # fmt: skip
    """Each fault under each policy on its own decode engine (``faults``).
    A decode engine that died in a cell is marked in it (``decode_died``)
    and, with ``start_again(policy)``, replaced in ``decode_by_policy`` by a
    new one before the next fault."""
    from vllm_nixl_hma.e2e import faults
    from vllm_nixl_hma.harness.coordinator import free_port

    dead_port = free_port()  # nothing listens there
    t = options.request_timeout_s
    results = []
    for name in sorted(options.faults, key=faults.ALL_FAULTS.index):
        progress(f"fault {name}")
        if name in faults.NETWORK_FAULTS and placement.topology is None:
            result = faults.FaultResult(name, "-", error="needs separate hosts")
            results.append(result)
            continue
        skips = [faults.skipped(name, p, options.connector) for p in decode_by_policy]
        if all(skips):  # stock: the fault needs what only ours sends (``faults.NEEDS_OURS``)
            progress(f"fault {name} skipped: {skips[0].error}")
            results += skips
            continue
        counted_before = {p: plugin_counts(d) for p, d in decode_by_policy.items()}
        if name in faults.TICKET_FAULTS:
            cells = _ticket_cells(name, prefill, decode_by_policy, expected, options, placement)
        else:
            cells = _transfer_fault_cells(
                name, prefill, decode_by_policy, expected, dead_port, t, placement, ticket_keys
            )
        results += _with_records(name, cells, decode_by_policy, counted_before)
        _replace_dead_decodes(results, decode_by_policy, start_again, progress)
    return results


def _transfer_fault_cells(
    name, prefill, decode_by_policy, expected, dead_port, t, placement, ticket_keys
):  # fmt: skip
    """A fault of the transfer or the link (not a ticket fault): prefill
    computes the prompt, the fault is injected, each policy's cell runs."""
    from vllm_nixl_hma.e2e import faults

    body = completion(prompt_ids(fault_prompt_tokens(name)))
    expected_tokens, _ = _tokens(expected[fault_prompt_tokens(name)])
    params = {policy: faults.prefill(prefill.url, body, t) for policy in faults.POLICIES}
    if name == "prefill-killed":
        prefill.kill()
    with _network_fault(name, placement):
        return _fault_cells(
            name, prefill, decode_by_policy, body, params, expected_tokens, dead_port, t,
            reachable=prefill.alive() and name not in _UNPLUGGED,
            placement=placement, ticket_keys=ticket_keys,
        )  # fmt: skip


def _engine_down(server) -> bool:
    """Whether ``server`` is gone or no longer healthy: vLLM's API server
    answers /health with an error for seconds after its engine core died,
    before it exits."""
    if not server.alive():
        return True
    try:
        status, _ = server.get("/health")
    except OSError:
        return True
    return status != 200


def _replace_dead_decodes(results, decode_by_policy, start_again, progress) -> None:
    """Mark the last fault's cells whose decode engine is gone, and start it again."""
    name = results[-1].name if results else None
    for policy, server in list(decode_by_policy.items()):
        if not _engine_down(server):
            continue
        for cell in results:
            if cell.name == name and cell.policy == policy:
                cell.decode_died = True
                cell.ok = False
        if start_again is not None:
            progress(f"decode engine ({policy}) died in {name}: starting it again")
            decode_by_policy[policy] = start_again(policy)


#: how long the counters of a fault cell may take to reach /metrics (vLLM
#: publishes connector stats with the step that produced them)
RECORDS_WAIT_S = 15.0


def plugin_counts(server) -> dict[str, int] | None:
    """The plugin's counters on ``server``'s /metrics (None: not there, a
    stock engine or none answering)."""
    from vllm_nixl_hma.e2e import plugin_metrics

    try:
        status, text = server.get("/metrics")
    except OSError:
        return None
    if status != 200 or "vllm:nixl_hma_decode_requests_total" not in text:
        return None
    return plugin_metrics.counts_from_metrics(text)


def _with_records(name, cells, decode_by_policy, counted_before):
    """Each cell of fault ``name`` with what its decode engine's counters
    (#27) grew by over it, judged (``plugin_metrics.fault_records_ok``):
    waits up to ``RECORDS_WAIT_S`` for the broken request to be counted."""
    from vllm_nixl_hma.e2e import faults, plugin_metrics

    may_deliver = name in faults.MAY_DELIVER
    for cell in cells:
        decode_server = decode_by_policy.get(cell.policy)
        before = counted_before.get(cell.policy)
        # not cell.error: under fail the broken request's error answer is the point
        if decode_server is None or before is None:
            continue
        deadline = time.monotonic() + RECORDS_WAIT_S
        while True:
            grown = plugin_metrics.delta(before, plugin_counts(decode_server) or {})
            cell.records_ok = plugin_metrics.fault_records_ok(name, cell.policy, grown, may_deliver)
            if cell.records_ok or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        cell.records = grown
        cell.ok = cell.ok and cell.records_ok
    return cells


def _plugin_metrics(servers) -> dict[str, Any]:
    """Per engine still alive: the plugin's counters on its /metrics and the
    same counts from its log's per-request records, and whether they agree
    (waiting up to ``RECORDS_WAIT_S`` for the last steps' stats); every
    decode engine must have counted reads."""
    from vllm_nixl_hma.e2e import plugin_metrics

    deadline = time.monotonic() + RECORDS_WAIT_S
    while True:
        metrics, records = {}, {}
        for server in servers:
            if not server.alive():
                continue
            counted = plugin_counts(server)
            metrics[server.name] = counted
            records[server.name] = plugin_metrics.counts_from_log(
                server.log_path.read_text(errors="replace")
            )
        match = bool(metrics) and all(
            counted is not None and plugin_metrics.records_match(counted, records[name])
            for name, counted in metrics.items()
        )
        if match or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    decodes_read = all(
        (counted or {}).get("decode/read/none", 0) > 0
        for name, counted in metrics.items()
        if name.startswith("decode")
    )
    # each read's time, from every decode engine's log (one that died too): a
    # stalled read and a slow link are told apart by these (#43)
    reads = {
        server.name: plugin_metrics.reads_from_log(server.log_path.read_text(errors="replace"))
        for server in servers
        if server.name.startswith("decode")
    }
    return {
        "metrics": metrics,
        "records": records,
        "records_match": match and decodes_read,
        "reads": reads,
        "slowest_reads": plugin_metrics.slowest_reads(reads),
    }


#: the networks each network fault unplugs the prefill host from
_UNPLUGGED = {"prefill-host-gone": ("data", "control"), "prefill-data-path-cut": ("data",)}


@contextlib.contextmanager
def _network_fault(name: str, placement: Placement):
    """The network as fault ``name`` leaves it, for the block's length."""
    networks = _UNPLUGGED.get(name)
    if networks is None:
        yield
        return
    placement.topology.set_link(HOST_OF_ENGINE["prefill"], up=False, networks=networks)
    try:
        yield
    finally:
        # back only for the faults after this one, which need a prefill engine
        placement.topology.set_link(HOST_OF_ENGINE["prefill"], up=True, networks=networks)


#: the networks each flap takes down for ``faults.LINK_FLAP_S`` in each cell
_FLAPPED = {"prefill-link-flap": ("data",)}


@contextlib.contextmanager
def _link_flap(name: str, placement: Placement):
    """The prefill host's ``_FLAPPED`` networks down as the block starts and
    up again ``LINK_FLAP_S`` later, from a timer thread, so that decode's
    read is under way while they are down; the block's end waits for them."""
    from vllm_nixl_hma.e2e import faults

    networks = _FLAPPED.get(name)
    if networks is None:
        yield
        return
    topology, host = placement.topology, HOST_OF_ENGINE["prefill"]
    topology.set_link(host, up=False, networks=networks)
    plug_back = threading.Timer(
        faults.LINK_FLAP_S, topology.set_link, (host,), {"up": True, "networks": networks}
    )
    plug_back.start()
    try:
        yield
    finally:
        plug_back.join()  # back before the next cell, also after an early answer
        # (again, should the timer's call have failed: the next cells need the link)
        topology.set_link(host, up=True, networks=networks)


def _fault_cells(
    name, prefill, decode_by_policy, body, params, expected_tokens, dead_port, t, reachable,
    placement, ticket_keys=None,
):  # fmt: skip
    """Fault ``name``'s cell under each policy: decode's answer to the broken
    request (a flap's cell inside ``_link_flap``), then the same engine's next
    request (P/D while prefill is ``reachable``, else a plain one)."""
    from vllm_nixl_hma.e2e import faults

    results = []
    for policy, decode_server in decode_by_policy.items():
        result = faults.FaultResult(name, policy)
        if params[policy] is None:
            result.error = "prefill returned no kv_transfer_params"
            results.append(result)
            continue
        with _link_flap(name, placement):
            started = time.monotonic()
            answer = faults.decode(
                decode_server.url, name, body, params[policy], dead_port, t, ticket_keys
            )
            result.elapsed_s = round(time.monotonic() - started, 1)
        tokens, _ = _tokens(answer)
        faults.verdict(result, answer, expected_tokens, tokens)
        # the same decode engine, the next request: P/D while prefill lives
        if reachable:
            next_params = faults.prefill(prefill.url, body, t)
            follow_up = {**body, "kv_transfer_params": next_params}
        else:
            follow_up = body
        next_answer = post_json(decode_server.url, "/v1/completions", follow_up, t)
        result.sent_at = round(answer.sent_at, 2)
        result.answered_at = round(next_answer.answered_at, 2)
        result.next_request_ok = (
            next_answer.status == 200 and _tokens(next_answer)[0] == expected_tokens
        )
        result.ok = result.ok and result.next_request_ok
        results.append(result)
    return results


def _ticket_cells(name, prefill, decode_by_policy, expected, options, placement):
    """Ticket fault ``name``'s cell under each policy (``faults.TICKET_FAULTS``):
    decode's answer to what a client without the key sends, the NIXL
    transfers that ended meanwhile, the fault's own checks, then the same
    engine's next P/D request."""
    from vllm_nixl_hma.e2e import faults

    t = options.request_timeout_s
    n = fault_prompt_tokens(name)
    body = completion(prompt_ids(n))
    expected_tokens, _ = _tokens(expected[n])
    results = []
    for policy, decode_server in decode_by_policy.items():
        result = faults.FaultResult(name, policy)
        params = faults.prefill(prefill.url, body, t)
        victim_n = faults.victim_prompt_tokens(n)
        victim_body = completion(prompt_ids(victim_n))
        victim = (
            faults.prefill(prefill.url, victim_body, t) if name == "other-request-ticket" else {}
        )
        if params is None or victim is None:
            result.error = "prefill returned no kv_transfer_params"
            results.append(result)
            continue
        if name == "replayed-ticket":  # the first use: read, and right
            reads_before = _nixl_reads_ended(decode_server)
            first = post_json(
                decode_server.url, "/v1/completions", {**body, "kv_transfer_params": params}, t
            )
            result.first_use_ok = first.status == 200 and _tokens(first)[0] == expected_tokens
            result.first_use_nixl_reads = _reads_between(reads_before, decode_server)
        # the fake prefill listens on this host's loopback: a decode engine on
        # another host could not reach it, so only one on this host counts
        on_this_host = placement.topology is None
        with faults.fake_prefill() as fake:
            forged = faults.forged_params(name, params, victim, fake.address)
            reads_before = _nixl_reads_ended(decode_server)
            started = time.monotonic()
            answer = post_json(
                decode_server.url, "/v1/completions", {**body, "kv_transfer_params": forged}, t
            )
            result.elapsed_s = round(time.monotonic() - started, 1)
            result.nixl_reads = _reads_between(reads_before, decode_server)
            if name == "fake-prefill-ticket" and on_this_host:
                result.dialed = fake.connections
        faults.verdict(result, answer, expected_tokens, _tokens(answer)[0])
        if name == "other-request-ticket":  # the victim's own request, untouched
            victim_answer = post_json(
                decode_server.url,
                "/v1/completions",
                {**victim_body, "kv_transfer_params": victim},
                t,
            )
            victim_tokens, _ = _tokens(expected[victim_n])
            result.victim_ok = (
                victim_answer.status == 200 and _tokens(victim_answer)[0] == victim_tokens
            )
        # the next request: the genuine params, whose ticket the forged ones did
        # not consume (their MAC did not match), so that decode reads and
        # prefill frees their blocks (left held, they filled prefill's small
        # KV cache until its lease ran out); a replayed ticket's first use
        # freed its blocks, so that cell asks prefill again
        next_params = faults.prefill(prefill.url, body, t) if name == "replayed-ticket" else params
        next_answer = post_json(
            decode_server.url, "/v1/completions", {**body, "kv_transfer_params": next_params}, t
        )
        result.sent_at = round(answer.sent_at, 2)
        result.answered_at = round(next_answer.answered_at, 2)
        result.next_request_ok = (
            next_params is not None
            and next_answer.status == 200
            and _tokens(next_answer)[0] == expected_tokens
        )
        result.ok = (
            result.ok
            and result.next_request_ok
            and result.nixl_reads == 0
            and result.victim_ok is not False
            and result.dialed in (None, 0)
            and (
                name != "replayed-ticket"
                or (result.first_use_ok and (result.first_use_nixl_reads or 0) > 0)
            )
        )
        results.append(result)
    return results


#: vLLM's NIXL transfers that failed, per engine label set
_NIXL_FAILED = re.compile(r"^vllm:nixl_num_failed_transfers_total(?:\{[^}]*\})?\s+(\S+)$", re.M)


def _nixl_reads_ended(decode) -> int | None:
    """NIXL transfers of ``decode`` that ended so far, done or failed (every
    read posted ends one way or the other, or is abandoned as failed after
    ``read_timeout_s``); None when the metrics are not there."""
    done = kv_reads_by_dp_rank(decode)
    try:
        status, text = decode.get("/metrics")
    except OSError:
        return None
    failed = _NIXL_FAILED.findall(text) if status == 200 else []
    if not done and not failed:
        return None
    return sum(done.values()) + int(sum(float(value) for value in failed))


def _reads_between(before: int | None, decode) -> int | None:
    after = _nixl_reads_ended(decode)
    return None if before is None or after is None else after - before


def _pd(router_url: str, n: int, options: E2EOptions) -> HTTPResult:
    return post_json(
        router_url, "/v1/completions", completion(prompt_ids(n)), options.request_timeout_s
    )


def _compare(
    n: int, expected: HTTPResult, answer: HTTPResult, concurrent: bool, api: str = "completions"
) -> PromptResult:
    prefill, decode = routers.served_by(answer)
    result = PromptResult(
        prompt_tokens=n,
        http_status=answer.status,
        concurrent=concurrent,
        api=api,
        prefill=prefill,
        decode=decode,
        sent_at=round(answer.sent_at, 2),
        answered_at=round(answer.answered_at, 2),
    )
    if expected.status != 200:
        result.error = f"reference engine: HTTP {expected.status}: {expected.error}"
        return result
    result.reference, reference_logprobs = _tokens(expected)
    if answer.status != 200:
        result.error = answer.error
        return result
    result.generated, logprobs = _tokens(answer)
    result.finish_reason = _finish_reason(answer)
    # a stream's status is sent before its tokens: an error after that is an
    # event in the stream, under HTTP 200
    result.error = _error_in_answer(answer)
    prefix = 0
    for ours, theirs in zip(result.generated, result.reference, strict=False):
        if ours != theirs:
            break
        prefix += 1
    result.matching_prefix = prefix
    result.match = result.generated == result.reference and len(result.generated) == MAX_TOKENS
    if logprobs and reference_logprobs:
        result.max_logprob_diff = max(
            abs(a - b) for a, b in zip(logprobs, reference_logprobs, strict=False)
        )
    return result


class _follow:  # noqa: N801 (a context manager)
    """With ``verbose``, copy every engine log in ``log_dir`` to stderr as it grows."""

    def __init__(self, log_dir: Path, verbose: bool):
        self.log_dir, self.verbose = log_dir, verbose
        self.done = threading.Event()

    def __enter__(self):
        if self.verbose:
            threading.Thread(target=self._copy, daemon=True).start()
        return self

    def _copy(self) -> None:
        import sys

        offsets: dict[Path, int] = {}
        while not self.done.wait(0.5):
            for path in sorted(self.log_dir.glob("*.log")):
                with open(path, errors="replace") as log:
                    log.seek(offsets.get(path, 0))
                    sys.stderr.write(log.read())
                    offsets[path] = log.tell()

    def __exit__(self, *exc_info) -> bool:
        self.done.set()
        return False

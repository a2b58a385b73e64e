"""Real vLLM engines (OpenAI servers on 127.0.0.1, vLLM's CPU build): a P/D
request must produce the tokens one engine produces, or fail; never other tokens.

Each run starts a reference engine, then a prefill and a decode engine, and
sends prompts through the P/D router (``vllm-nixl-hma e2e``): minutes on 2 cores.
The stock cells show that the check can fail: vLLM 0.21.0's NixlConnector cannot
even start on the GatedDeltaNet hybrid.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path

import pytest

from vllm_nixl_hma.e2e.faults import ALL_FAULTS, FAULTS, LINK_FLAP_S, POLICIES, TICKET_FAULTS
from vllm_nixl_hma.e2e.run import E2EOptions, run_e2e

pytestmark = pytest.mark.e2e


def e2e(tmp_path, **options):
    """The report, and for assertion messages the run's log (``RunLog``)."""
    import json

    lines: list[str] = []
    report = run_e2e(E2EOptions(**options), tmp_path, lines.append)
    # whole, beside the engines' logs, for whoever reads a failed run
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    return report, RunLog("\n".join([*lines, report_in_short(report)]), tmp_path)


@dataclasses.dataclass(frozen=True)
class RunLog:
    """The progress lines and the report in short (``str``), and the folder
    of the engines' logs, which ``failed`` reads."""

    text: str
    log_dir: Path

    def __str__(self) -> str:
        return f"{self.text}\n{engine_log_excerpt(self.log_dir)}"


def report_in_short(report) -> str:
    """The report with one line per prompt (its generated token ids left
    out): CI keeps the head and the tail of a failed run's output, and the
    whole report pushed the engines' lines out of both."""
    import json

    rest = {key: value for key, value in report.items() if key != "prompts"}
    shown = [
        json.dumps({key: value for key, value in prompt.items() if key != "generated"})
        for prompt in report.get("prompts", [])
    ]
    return "\n".join(["report, prompts one a line:", *shown, json.dumps(rest, indent=1)])


#: engine log lines that say why a request failed (ours, vLLM's errors)
WHY_A_REQUEST_FAILED = ("NixlHMAConnector", "ERROR", "Traceback", "Error:")
#: a traceback's frames and source lines, as vLLM's logger prints them: not the why
TRACEBACK_FRAME = re.compile(r"\]\s{2,}|\] Traceback \(most recent call last\)")
#: the time vLLM's logger stamps on a line (local time, no year)
LOG_TIME = re.compile(r" (\d\d-\d\d \d\d:\d\d:\d\d) ")
#: engine lines this long after a failed request's answer still belong to it
#: (vLLM's pre-aborted copy of a failed request handshakes once more)
AFTER_ANSWER_S = 30.0


def _logged_at(line: str) -> float | None:
    stamp = LOG_TIME.search(line)
    if stamp is None:
        return None
    year = time.localtime().tm_year
    return time.mktime(time.strptime(f"{year}-{stamp.group(1)}", "%Y-%m-%d %H:%M:%S"))


def engine_log_excerpt(log_dir, lines_per_engine: int = 25, between=None) -> str:
    """Each engine's log lines that say why something failed, traceback
    frames left out: the last ``lines_per_engine``, or with ``between``
    (wall-clock seconds, first and last) every one stamped then. CI keeps
    only the end of a failed run's output, not the engines' logs."""
    parts = []
    for path in sorted(Path(log_dir).glob("*.log")):
        said = [
            line.rstrip()[:300]
            for line in path.read_text(errors="replace").splitlines()
            if any(word in line for word in WHY_A_REQUEST_FAILED)
            and not TRACEBACK_FRAME.search(line)
        ]
        if between is None:
            heading = f"--- {path.name}, last {lines_per_engine} of {len(said)}"
            said = said[-lines_per_engine:]
        else:
            heading = f"--- {path.name}, while it ran"
            first, last = between
            said = [
                line
                for line in said
                if (at := _logged_at(line)) is not None and first - 1.0 <= at <= last + 1.0
            ]
        if said:
            parts += [heading, *said]
    return "\n".join(parts)


def failed(what, log) -> str:
    """An assertion message: the run's log, then what failed and, for a
    prompt or a fault cell, what the engines said while it ran (CI shows the
    end of the output)."""
    message = f"{log}\n=== failed: {what}"
    if isinstance(what, dict) and what.get("sent_at"):
        window = (what["sent_at"], what.get("answered_at", what["sent_at"]) + AFTER_ANSWER_S)
        message += "\n=== the engines while it ran:\n" + engine_log_excerpt(
            log.log_dir, between=window
        )
    return message


def assert_every_prompt_matches(report, log, pairs=1):
    # four prompts one by one, a concurrent batch (three, or two per engine pair)
    assert len(report["prompts"]) == 4 + (3 if pairs == 1 else 2 * pairs) + 2, log
    # seven completions, then one chat prompt answered whole and streamed
    assert [p["api"] for p in report["prompts"]][-3:] == ["completions", "chat", "chat-stream"]
    for prompt in report["prompts"]:
        assert prompt["http_status"] == 200 and prompt["match"], failed(prompt, log)


#: the hosts of a run with two prefill and two decode engines
TWO_BY_TWO_HOSTS = {"router", "ref", "prefill", "prefill1", "decode", "decode1", "decoderc"}


def assert_every_pair_served(report, log):
    """Two prefill and two decode engines: each decode engine got prompts
    from each prefill engine, and every one of them matched."""
    pairs = {(p["prefill"], p["decode"]): p for p in report["pairs"]}
    assert set(pairs) == {
        (p, d) for p in ("prefill", "prefill-1") for d in ("decode", "decode-1")
    }, log
    for pair in pairs.values():
        assert pair["routed"] >= 2 and pair["matched"] == pair["routed"], failed(pair, log)
    assert {(p["prefill"], p["decode"]) for p in report["prompts"]} == set(pairs), log


#: a link that comes back may let the read finish whole: the reference tokens
#: are right then under ``fail`` too (an error still is)
MAY_ARRIVE_WHOLE = {"prefill-link-flap"}


def assert_conversation_reuses_both_caches(report, log):
    """``e2e --prefix-caching``: every turn (and the control prompt) matched
    one engine; from turn 2 on, prefill and decode each found the turns
    before in their prefix cache (vLLM's own counters), and decode read
    fewer blocks and bytes than for the control, a prompt as long as the
    last turn that shares nothing with it."""
    turns, control = report["turns"], report["turns_control"]
    assert len(turns) >= 2 and [t["turn"] for t in turns] == list(range(1, len(turns) + 1))
    assert all(t["match"] and t["http_status"] == 200 for t in [*turns, control]), failed(
        [*turns, control], log
    )
    assert control["decode_prefix_hit_tokens"] == 0, failed(control, log)
    for turn in turns[1:]:
        assert turn["prefill_prefix_hit_tokens"] > 0, failed(turns, log)
        assert turn["decode_prefix_hit_tokens"] > 0, failed(turns, log)
        assert 0 < turn["decode_blocks_read"] < control["decode_blocks_read"], failed(turns, log)
    assert 0 < turns[-1]["decode_kv_bytes_read"] < control["decode_kv_bytes_read"], failed(
        [turns[-1], control], log
    )
    assert report["conversation_ok"], log


def assert_every_fault_fails_closed(report, log, faults=FAULTS):
    """Every fault under both policies: an error under ``fail``, the
    reference's tokens under ``recompute``, never HTTP 200 with other tokens;
    then the same decode engine answers the next request right. A flap must
    have hit the read: an answer with the KV waited for the link to return."""
    assert {(f["name"], f["policy"]) for f in report["faults"]} == {
        (name, policy) for name in faults for policy in POLICIES
    }, log
    for fault in report["faults"]:
        assert fault["outcome"] != "wrong tokens", failed(fault, log)
        if fault["policy"] == "recompute":
            expected = {"reference tokens"}
        elif fault["name"] in MAY_ARRIVE_WHOLE:
            expected = {"error", "reference tokens"}
        else:
            expected = {"error"}
        assert fault["outcome"] in expected, failed(fault, log)
        if fault["name"] == "prefill-link-flap" and fault["outcome"] == "reference tokens":
            assert fault["elapsed_s"] >= LINK_FLAP_S - 1.0, failed(fault, log)
        assert fault["next_request_ok"], failed(fault, log)
        if fault["name"] in TICKET_FAULTS:
            assert_refused_without_a_read(fault, log)
        assert fault["ok"], failed(fault, log)
    if any(f["name"] in TICKET_FAULTS for f in report["faults"]):
        assert_decode_named_each_refusal(log)


def assert_plugin_metrics_account_for_the_run(report, log, d_tp: int):
    """#27 through real engines: every engine's /metrics shows the plugin's
    counters and they equal what its log's per-request records add up to;
    each decode engine counted a read per decode TP rank for every prompt
    routed to it at least; each fault cell grew its decode engine's counters
    by the fault's own class under its policy (``plugin_metrics``)."""
    assert report["records_match"] is True, failed(
        {"metrics": report["metrics"], "records": report["records"]}, log
    )
    for name, counts in report["metrics"].items():
        assert counts == report["records"][name], failed({name: counts}, log)
    routed = {}
    for pair in report["pairs"]:
        routed[pair["decode"]] = routed.get(pair["decode"], 0) + pair["routed"]
    for decode, prompts in routed.items():
        reads = report["metrics"][decode].get("decode/read/none", 0)
        assert reads >= prompts * d_tp, failed({decode: report["metrics"][decode]}, log)
    for fault in report["faults"]:
        assert fault["records_ok"] is True, failed(fault, log)
        not_read = {k for k in fault["records"] if k.startswith("decode/") and "/read/" not in k}
        if fault["policy"] == "recompute":
            assert all(k.startswith("decode/recomputed/") for k in not_read), failed(fault, log)


def assert_side_channel_survived(report, log):
    """#25 item 3, on a live engine: prefill's side channel took at least
    1000 bad queries from raw ZMQ clients, then answered a real query for
    every rank, and (the run's prompts) decode's handshakes after it; its
    log warned of them at most a few times (once per peer per 30 s: the
    barrage comes from one address)."""
    barrage = report["side_channel_barrage"]
    assert barrage["sent"]["total"] >= 1000 and barrage["sent"]["unsent"] == 0, (barrage, log)
    assert barrage["ranks_answered_after"] and all(barrage["ranks_answered_after"]), (barrage, log)
    prefill_log = (log.log_dir / "prefill.log").read_text(errors="replace")
    warnings = prefill_log.count("NIXL side channel: dropped a query from")
    assert 1 <= warnings <= 5, (warnings, log)
    assert "listener gave up" not in prefill_log and "listener failed" not in prefill_log, log


#: why decode refuses each ticket fault (core.tickets' reasons)
TICKET_REFUSAL = {
    "other-request-ticket": "forged or edited",  # another request's block ids
    "edited-ticket": "forged or edited",  # the lease moved
    "replayed-ticket": "replayed",
    "fake-prefill-ticket": "forged or edited",  # a made-up MAC under the run's key id
}


def assert_refused_without_a_read(fault, log):
    """No NIXL transfer of decode ended while it answered (none was posted:
    every posted read ends done or failed), the fault's own checks held."""
    assert fault["nixl_reads"] == 0, failed(fault, log)
    if fault["name"] == "other-request-ticket":
        assert fault["victim_ok"] is True, failed(fault, log)
    if fault["name"] == "replayed-ticket":
        # the counters' control: the first use read, and got its tokens
        assert fault["first_use_ok"] is True, failed(fault, log)
        assert fault["first_use_nixl_reads"] > 0, failed(fault, log)
    if fault["name"] == "fake-prefill-ticket":
        assert fault["dialed"] in (None, 0), failed(fault, log)


def assert_decode_named_each_refusal(log):
    """Each decode engine's log names the refusal of each ticket fault it got,
    with the reason (once per cell at least)."""
    text = "".join(path.read_text(errors="replace") for path in log.log_dir.glob("decode*.log"))
    for reason in set(TICKET_REFUSAL.values()):
        cells = sum(1 for r in TICKET_REFUSAL.values() if r == reason) * len(POLICIES)
        assert text.count(f"transfer ticket refused ({reason})") >= cells, (reason, log)


def assert_moe_path(report, engines, amx: bool):
    """The fused-MoE path each engine logged is the one for what it was told
    (and for the kernels this host's vLLM library has: none on a host
    without AVX-512)."""
    from vllm_nixl_hma.e2e import cpu_moe

    seen = report["cpu"]["moe_paths"]
    kernels = report["cpu"]["host_grouped_gemm_kernels"]
    assert kernels is not None, report["cpu"]
    for engine in engines:
        expected = cpu_moe.expected_path(amx, grouped_gemm_kernels=kernels)
        assert seen.get(engine) == [expected], (engine, report["cpu"])


def test_ours_heterogeneous_hybrid_across_hosts_through_vllm_router_matches_and_fails_closed(
    tmp_path,
):
    """Prefill TP 2 -> decode TP 1, GatedDeltaNet + attention, unequal ratios,
    every engine and the router on a host of its own (network namespaces on
    10 Gbit/s links, the KV over TCP on the data network as between hosts
    without RDMA), the prompts routed by vLLM's own router (``vllm-router``,
    what users deploy: it copies prefill's kv_transfer_params, our lease
    field included, to decode); then every fault under both failure
    policies: a handshake that cannot complete, a lease that ran out (once
    took the fail-policy decode engine down), block lists that cannot be
    paired, prefill killed before decode reads. Its MoE layer runs this
    host's own path. Every engine keeps prefix caching (#26): a four-turn
    conversation must hit prefill's and decode's caches from its second turn
    and read only each turn's new tokens, token-identical to one engine."""
    report, log = e2e(
        tmp_path,
        p_tp=2,
        d_tp=1,
        faults=FAULTS,
        separate_hosts=True,
        router="vllm-router",
        prefix_caching=True,
    )
    assert report["remote_ratio"] != report["local_ratio"], log  # the 0.21.0 bug's setting
    assert report["router"] == "vllm-router", log
    # the pair is read from vLLM's answer id, which vllm-router's request id names
    assert report["pairs"] == [
        {"prefill": "prefill", "decode": "decode", "routed": 9, "matched": 9}
    ], failed(report["pairs"], log)
    assert report["kv_reads"]["decode"] >= 9, failed(report["kv_reads"], log)
    assert_every_prompt_matches(report, log)
    assert_kv_crossed_the_link(report, log)
    assert_every_fault_fails_closed(report, log)
    assert_plugin_metrics_account_for_the_run(report, log, d_tp=1)
    assert_side_channel_survived(report, log)
    assert_conversation_reuses_both_caches(report, log)
    assert_moe_path(report, ("reference", "prefill", "decode"), report["cpu"]["host_amx"])
    assert report["ok"]
    assert not [name for name in namespaces() if name.startswith(f"vnh{os.getpid()}-")]


def test_ours_dense_across_hosts_matches_one_engine_and_fails_closed_on_every_fault(tmp_path):
    """Dense Llama, 1 -> 1, without HMA (vLLM 0.21.0 turns it off for a model
    without Mamba layers when a connector is configured), every engine on a
    host of its own: every prompt, then every fault under both policies, the
    transfer's (before issue #21's fix the lease refusal answered HTTP 200
    with tokens computed on blocks nobody filled) and the network's:
    prefill's data link down for a few seconds while decode reads, the
    prefill host unplugged after prefill answered (before ``read_timeout_s``
    the fail-policy request hung for good), its data link alone unplugged
    while its side channel answers; prefill killed last. Two prefill and two
    decode engines behind the router (2P2D): every decode engine reads from
    every prefill engine, the faults hit the first of each, and after the
    first prefill engine is killed the router's prompts to the other still
    match. One set of engines for all of this keeps CI short; the hybrid runs
    the transfer faults across hosts too, passed the network ones by hand and
    2P2D on one host (docs/measurements.md)."""
    report, log = e2e(
        tmp_path,
        model="dense",
        p_tp=1,
        d_tp=1,
        faults=ALL_FAULTS,
        separate_hosts=True,
        prefills=2,
        decodes=2,
    )
    assert_every_prompt_matches(report, log, pairs=4)
    assert_every_pair_served(report, log)
    assert_kv_crossed_the_link(report, log, TWO_BY_TWO_HOSTS)
    assert_every_fault_fails_closed(report, log, ALL_FAULTS)
    assert_plugin_metrics_account_for_the_run(report, log, d_tp=1)
    assert_side_channel_survived(report, log)
    assert_no_callback_raised(tmp_path)
    # prefill was killed last: the router's prompts to it fail, to prefill-1 match
    after = report["after_faults"]
    assert {p["prefill"] for p in after} == {"prefill", "prefill-1"}, log
    for prompt in after:
        if prompt["prefill"] == "prefill":
            assert prompt["http_status"] != 200, failed(prompt, log)
        else:
            assert prompt["http_status"] == 200 and prompt["match"], failed(prompt, log)
    assert report["ok"]


def namespaces() -> list[str]:
    import json
    import subprocess

    listed = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True)
    return [entry["name"] for entry in json.loads(listed.stdout or "[]")]


def assert_kv_crossed_the_link(
    report, log, hosts=frozenset({"router", "ref", "prefill", "decode", "decoderc"})
):
    """The hosts' addresses exist only in their namespaces, and what decode's
    NIXL read (vLLM's own byte count) left prefill's interface and entered
    decode's: the KV crossed the link, not shared memory."""
    import subprocess

    root_addresses = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True).stdout
    assert set(report["hosts"]) == set(hosts), log
    for host in report["hosts"].values():
        assert f'"{host["address"]}"' not in root_addresses, failed(host, log)
        assert f'"{host["data_address"]}"' not in root_addresses, failed(host, log)
    link = report["link"]
    kv = link["kv_bytes_read"]
    assert kv and kv > 100_000, log  # every prompt's attention KV and Mamba state
    assert link["bytes_during_prompts"]["prefill"]["tx_bytes"] >= kv, log
    assert link["bytes_during_prompts"]["decode"]["rx_bytes"] >= kv, log


def test_stock_cannot_serve_the_hybrid(tmp_path):
    """Stock refuses the hybrid at start. Its run also starts the reference
    engine on the other kind of host's MoE path (told AMX where the host has
    none, and the other way round): the path the hybrid test does not take."""
    from vllm_nixl_hma.e2e import cpu_moe

    other_amx = not cpu_moe.host_has_amx()
    report, log = e2e(
        tmp_path,
        connector="NixlConnector",
        p_tp=2,
        d_tp=1,
        cpu_amx="amx" if other_amx else "no-amx",
    )
    assert_moe_path(report, ("reference",), other_amx)
    assert report["start_failure"]["engine"] == "prefill", log
    assert "GDN_ATTN" in report["start_failure"]["last_error"], log
    assert not report["ok"]
    # its worker refuses GatedDeltaNet state at start; were it to start, no prompt
    # may pass as a match
    assert report.get("error") or not all(p["match"] for p in report["prompts"]), log
    assert not any(p["match"] and p["http_status"] == 200 for p in report["prompts"]), log


def stock_first_handshake_went_unanswered(workdir) -> bool:
    """Stock's decode asks prefill's side channel once and waits a fixed 5 s;
    an unanswered first query fails the request, and stock 0.21.0's decode
    engine then dies (KeyError in get_finished). On this 2-core host that first
    query sometimes goes unanswered (README, Known limits)."""
    for decode_log in Path(workdir).glob("decode*.log"):  # every decode engine's
        text = decode_log.read_text(errors="replace")
        if "handshake_setup_failed" in text and "zmq.error.Again" in text:
            return True
    return False


def test_ours_every_layer_window_recomputes_from_token_zero_on_every_fault(tmp_path):
    """#41: a Mistral-shaped model (every layer over a window of 8 tokens,
    shorter than a logical block of 128; one sliding-window KV cache group,
    prompts far past the window), prefill TP 2 -> decode TP 1, decode keeping
    vLLM's default prefix caching. Two defects had this shape: under
    ``recompute`` a failed request resumed at the window's first block over
    null blocks, and its next request (the same prompt) hit the wrong blocks
    decode had cached (4 cells on the 256-token window, ``swa-only``; the
    one-group shape itself: tests/integration/test_window_recompute.py);
    and decode, holding one block, paired prefill's list cut to its first
    block and read it, HTTP 200 with wrong tokens under both policies
    (``unpairable-block-lists``). Every cell must now give an error or one
    engine's tokens, and so must the next request.

    CI's one sliding-window e2e run: it replaced the run of a window layer
    beside full attention (1 -> 1, every fault; 60 minutes from nothing),
    which vLLM runs without HMA as one full-attention group, the path the
    dense runs across hosts take (that fold: test_window_recompute.py; the
    shape's last CI run: docs/measurements.md). The 256-token window is a
    hand run (``e2e --model swa-only --faults``)."""
    report, log = e2e(tmp_path, model="swa-only-8", p_tp=2, d_tp=1, faults=FAULTS)
    assert_every_prompt_matches(report, log)
    assert_every_fault_fails_closed(report, log)  # recompute: the reference, and next too
    assert_plugin_metrics_account_for_the_run(report, log, d_tp=1)
    assert_side_channel_survived(report, log)
    assert_no_callback_raised(tmp_path)
    assert report["ok"]


def assert_no_callback_raised(workdir):
    """vLLM 0.21.0's handshake-failure callback raised IndexError on a request
    with no KV cache group (the serving layer's pre-aborted copy after an
    error answer) in the dense decode engines; concurrent.futures logs and
    swallows it, so only the logs tell."""

    for log in Path(workdir).glob("decode*.log"):
        text = log.read_text(errors="replace")
        assert "exception calling callback" not in text, log


def test_stock_dense_matches_across_hosts(tmp_path):
    """The harness is not hostile to stock: a dense model at equal TP passes,
    with every engine on a host of its own and the KV across the link. Stock
    gets a second run only when its first failed on its one-shot first
    handshake (nothing else), and says so. One engine of each role keeps CI
    short on a slow host; stock's 2P2D run (as ours runs here) passed by
    hand (docs/measurements.md, "Several engines")."""
    options = dict(
        model="dense",
        connector="NixlConnector",
        p_tp=1,
        d_tp=1,
        separate_hosts=True,
        forged_read_probe=True,
    )
    first = tmp_path / "first"
    first.mkdir()
    report, log = e2e(first, **options)
    if not report["ok"] and stock_first_handshake_went_unanswered(first):
        print(f"stock's first handshake went unanswered in 5 s (see {first}); running again")
        second = tmp_path / "second"
        second.mkdir()
        report, log = e2e(second, **options)
    assert report["ok"], log
    assert_every_prompt_matches(report, log)
    assert_kv_crossed_the_link(report, log)
    # #25: the request ours refuses as other-request-ticket (this prompt's
    # params, another in-flight request's block ids): stock reads those
    # blocks and answers HTTP 200 with tokens of neither prompt's reference
    forged = report["forged_read"]
    assert forged["nixl_reads"] > 0, failed(forged, log)
    assert forged["http_status"] == 200, failed(forged, log)
    assert forged["outcome"] == "wrong tokens", failed(forged, log)

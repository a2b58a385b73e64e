"""``vllm-nixl-hma``'s command line: help without vLLM, usage errors, the table."""

from __future__ import annotations

import subprocess
import sys

from vllm_nixl_hma.cli import ExitCode, main, render_table
from vllm_nixl_hma.harness.coordinator import ScenarioResult


def test_help_is_instant_and_imports_no_vllm():
    script = (
        "import sys; from vllm_nixl_hma.cli import main\n"
        "try:\n    main(['check', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('vllm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.strip().endswith("False")
    assert "--model-config" in out and "--json" in out


def test_usage_errors_exit_4():
    assert main(["check", "--connector", "Nope"]) == ExitCode.USAGE_ERROR
    assert main(["frobnicate"]) == ExitCode.USAGE_ERROR


def test_e2e_prefix_caching_on_and_off_exclude_each_other(tmp_path, capfd):
    argv = ["e2e", "--prefix-caching", "--no-prefix-caching", "--model", str(tmp_path)]
    assert main(argv) == ExitCode.USAGE_ERROR
    assert "not allowed with argument" in capfd.readouterr().err


def test_a_stock_fault_run_names_each_skipped_fault_and_why():
    """#41: ``e2e --faults --connector NixlConnector`` skips the faults that
    need our lease field, and the table says so rather than 'WRONG'."""
    from vllm_nixl_hma.cli import render_e2e
    from vllm_nixl_hma.e2e import faults

    cells = [faults.skipped("lease-expired", p, "NixlConnector") for p in faults.POLICIES]
    report = {
        "model": "swa-only", "connector": "NixlConnector", "p_tp": 1, "d_tp": 1,
        "remote_ratio": 1, "local_ratio": 1, "prompts": [],
        "faults": [c.as_json() for c in cells],
    }  # fmt: skip
    shown = render_e2e(report)
    assert "skipped lease-expired: stock's kv_transfer_params carry no lease" in shown
    row = next(line for line in shown.splitlines() if line.startswith("lease-expired"))
    assert "WRONG" not in row and "NO" not in row.split()


def test_table_lists_failures_and_counts():
    good = ScenarioResult("mid-block", 1, 2, "hybrid", 3, 5, 3, 1000, 0, 2**20, 10, 0.5)
    bad = ScenarioResult("boundary", 2, 1, "hybrid", 5, 3, 3, 1000, 7, 2**20, 10, 0.5)
    bad.examples = ["req 0 layer 1 kernel block 4: 7 wrong"]
    table = render_table([good, bad])
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["scenario", "P_TP", "D_TP", "layout"]
    assert "FAILED boundary P_TP=2 D_TP=1 hybrid: 7 mismatched slots" in table
    assert "req 0 layer 1 kernel block 4: 7 wrong" in table
    assert lines[-1] == "1 passed, 1 failed"


def test_e2e_across_hosts_without_the_rights_says_so_and_exits_5(mocker, tmp_path, capfd):
    """Separate hosts need root (network namespaces): without it, one line
    says so, nothing starts, exit 5."""
    from vllm_nixl_hma.e2e import netns

    mocker.patch.object(netns.os, "geteuid", return_value=1000)
    started = mocker.patch("vllm_nixl_hma.e2e.servers.ServerSet.start")
    assert main(["e2e", "--separate-hosts", "--model", str(tmp_path)]) == ExitCode.NOTHING_RAN
    started.assert_not_called()
    err = capfd.readouterr().err
    assert "[e2e] failed: separate hosts need network namespaces, which only root" in err


def test_e2e_refuses_a_link_rate_tc_cannot_read(tmp_path, capfd):
    argv = ["e2e", "--separate-hosts", "--link-rate", "fast", "--model", str(tmp_path)]
    assert main(argv) == ExitCode.USAGE_ERROR
    assert "link rate 'fast'" in capfd.readouterr().err


def test_the_e2e_table_shows_the_hosts_and_what_crossed_the_data_links():
    from vllm_nixl_hma.cli import render_e2e

    grown = {"tx_bytes": 10, "rx_bytes": 20}
    report = {
        "model": "hybrid",
        "connector": "NixlHMAConnector",
        "p_tp": 2,
        "d_tp": 1,
        "remote_ratio": 8,
        "local_ratio": 16,
        "prompts": [],
        "faults": [],
        "hosts": {
            "prefill": {
                "namespace": "vnh1-prefill",
                "address": "10.1.1.3",
                "data_address": "10.51.1.3",
            },
            "decode": {
                "namespace": "vnh1-decode",
                "address": "10.1.1.4",
                "data_address": "10.51.1.4",
            },
        },
        "link": {
            "rate": "10gbit",
            "bytes_during_prompts": {
                "prefill": {"tx_bytes": 2500451, "rx_bytes": 1},
                "decode": {**grown, "rx_bytes": 2502122},
            },
            "kv_bytes_read": 2367488,
        },
    }
    lines = render_e2e(report).splitlines()
    assert (
        lines[1]
        == "hosts (control, data address): prefill 10.1.1.3 10.51.1.3, decode 10.1.1.4 10.51.1.4"
    )
    assert lines[2] == (
        "links 10gbit, data network during the P/D prompts: prefill sent 2500451 B, decode "
        "received 2502122 B; decode's NIXL read 2367488 B of KV"
    )


def test_with_several_engines_every_pair_is_counted_and_a_pair_that_never_matched_fails():
    from types import SimpleNamespace

    from vllm_nixl_hma.cli import render_e2e
    from vllm_nixl_hma.e2e.run import PromptResult, concurrent_lengths, pair_counts

    prefills = [SimpleNamespace(name=n) for n in ("prefill", "prefill-1")]
    decodes = [SimpleNamespace(name=n) for n in ("decode", "decode-1")]
    results = [
        PromptResult(5, match=True, http_status=200, prefill="prefill", decode="decode"),
        PromptResult(6, match=True, http_status=200, prefill="prefill", decode="decode-1"),
        PromptResult(7, match=True, http_status=200, prefill="prefill-1", decode="decode"),
        PromptResult(8, match=False, http_status=500, prefill="prefill-1", decode="decode-1"),
        PromptResult(9, match=True, http_status=200, prefill="prefill", decode="decode"),
    ]
    pairs = pair_counts(prefills, decodes, results)
    assert [(p["prefill"], p["decode"], p["routed"], p["matched"]) for p in pairs] == [
        ("prefill", "decode", 2, 2),
        ("prefill", "decode-1", 1, 1),
        ("prefill-1", "decode", 1, 1),
        ("prefill-1", "decode-1", 1, 0),
    ]
    report = {
        "model": "dense",
        "connector": "NixlHMAConnector",
        "p_tp": 1,
        "d_tp": 1,
        "remote_ratio": 8,
        "local_ratio": 8,
        "prompts": [r.as_json() for r in results],
        "faults": [],
        "pairs": pairs,
    }
    text = render_e2e(report)
    assert "FAILED pair prefill-1 -> decode-1: 1 prompt(s) routed, none matched" in text
    assert text.endswith("4 passed, 2 failed")
    # the concurrent batch: distinct prompts, as many as asked
    assert concurrent_lengths([10, 20, 30], 8) == [10, 20, 30, 13, 23, 33, 16, 26]


def test_engine_counts_outside_one_to_four_are_usage_errors(tmp_path, capfd):
    assert main(["e2e", "--prefills", "0", "--model", str(tmp_path)]) == ExitCode.USAGE_ERROR
    assert main(["e2e", "--decodes", "5", "--model", str(tmp_path)]) == ExitCode.USAGE_ERROR
    assert "a number of engines from 1 to 4" in capfd.readouterr().err


def test_after_a_prefill_engine_is_killed_only_its_own_prompts_may_fail():
    from vllm_nixl_hma.e2e.run import PromptResult, survivors_served

    def answer(prefill, status, match):
        return PromptResult(9, match=match, http_status=status, prefill=prefill, decode="decode")

    gone, healthy = answer("prefill", 502, False), answer("prefill-1", 200, True)
    assert survivors_served([gone, healthy, gone, healthy], gone="prefill")
    # the healthy engine's prompt must match; the gone engine's must not answer 200
    assert not survivors_served([gone, answer("prefill-1", 200, False)], gone="prefill")
    assert not survivors_served([answer("prefill", 200, True), healthy], gone="prefill")
    # a round that never reached the gone engine (or never the healthy one) proves nothing
    assert not survivors_served([healthy, healthy], gone="prefill")
    assert not survivors_served([gone], gone="prefill")


def test_reads_per_dp_rank_come_from_the_engine_label_of_vllms_nixl_histogram():
    from vllm_nixl_hma.e2e.run import every_dp_rank_read, kv_reads_by_dp_rank

    class Decode:
        def __init__(self, text):
            self.text = text

        def get(self, path):
            assert path == "/metrics"
            return 200, self.text

    text = (
        "# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration\n"
        'vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.005",model_name="model"} 2.0\n'
        'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="model"} 5.0\n'
        'vllm:nixl_xfer_time_seconds_count{engine="1",model_name="model"} 4.0\n'
        'vllm:nixl_post_time_seconds_count{engine="1",model_name="model"} 9.0\n'
    )
    assert kv_reads_by_dp_rank(Decode(text)) == {"0": 5, "1": 4}
    assert every_dp_rank_read({"decode": {"0": 5, "1": 4}}, 2)
    # a rank that read nothing, or no metric at all, fails a data-parallel run
    assert not every_dp_rank_read({"decode": {"0": 9}}, 2)
    assert not every_dp_rank_read({}, 2)
    assert every_dp_rank_read(None, 1)

"""Runs P/D cells on a pool of rank processes and turns results into rows.

A *cell* is one prefill engine and one decode engine (P_TP x D_TP, a model
layout, a connector); a *scenario* is one batch of concurrent requests moved
through it. The coordinator allocates every request's blocks the way each
engine's scheduler would (its own logical block size, sliding-window
clipping, one Mamba state block), tells prefill to write oracle codes and
decode to poison, lets decode read through the connector while prefill
serves notifications, and collects decode's verdict. Rank processes are
spawned once and reused for every cell.
"""

from __future__ import annotations

import collections
import math
import multiprocessing
import os
import random
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_nixl_hma.core import lease
from vllm_nixl_hma.harness.rank import NETNS_ENV, rank_main

COMMAND_TIMEOUT_S = 300.0
#: how a rank's refusal of the model's cache starts (harness.layout.UnsupportedArchitecture)
UNSUPPORTED_ARCHITECTURE = "UnsupportedArchitecture: "
# Generous: once in several suite runs on a loaded 2-core machine, every read
# of one cell took over 30 s (cause not established; a loopback TCP connect
# whose SYN is dropped retries after 1, 3, 7, 15, 31 s, which would fit).
TRANSFER_TIMEOUT_S = 120.0
LEASE_S = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default
SHORT_LEASE_S = 0.5
#: the late-read fault: the lease ends this long after the reads may start
#: (plus decode's margin); decode first polls this long after the lease end
LATE_READ_HEADROOM_S = 2.0
LATE_READ_POLL_AFTER_S = 0.5
LOST_NOTIFICATION_LEASE_S = 2.0


@dataclass
class Scenario:
    """A batch of concurrent requests; lengths are chosen once both engines'
    logical block sizes are known."""

    #: "mid-block", "boundary", "decode-hit", "no-hit", "prefill-hit", "long" or "one-long"
    name: str
    #: fault injection: decode is sent to a side-channel port nobody listens on
    dead_side_channel: bool = False
    #: fault injection: prefill is killed this long after decode posted its reads
    kill_prefill_after_s: float | None = None
    #: fault injection: the first request's first attention group is sent to
    #: decode with only the first of prefill's block ids (the request spans
    #: three or more), a list no rounding explains: it must fail alone, the
    #: others arrive intact
    unpairable_first_request: bool = False
    #: fault injection: the first request's token span (what decode's scheduler
    #: hands its workers) claims ``bad_span_blocks`` prefill logical blocks
    #: more than its lists hold (fewer if negative): no list fits it, it must
    #: fail alone
    bad_span_first_request: bool = False
    bad_span_blocks: int = 2
    #: fault injection: the reads start inside prefill's lease, but decode
    #: first asks what finished after the lease ended (a read that finished
    #: late must not be trusted); the batch before it makes the handshake
    late_read: bool = False

    def prompt_tokens(self, prefill_block_tokens: int, decode_block_tokens: int) -> list[int]:
        larger = max(prefill_block_tokens, decode_block_tokens)
        smaller = min(prefill_block_tokens, decode_block_tokens)
        if self.name == "mid-block":
            # block sizes are multiples of 16: none of these ends on a boundary
            return [2 * larger + 7, larger + smaller // 2 + 5, 5]
        if self.name == "long":
            # big enough that reads over TCP take a few hundred milliseconds
            return [1200 * larger + 7, 1200 * larger + 11, 1200 * larger + 13]
        if self.name == "one-long":
            # one request as long as the three of "long" together (the size a
            # link benchmark needs: 70 MiB and more on the embedded layouts)
            return [3600 * larger + 7]
        if self.name in ("decode-hit", "no-hit"):
            hits = Scenario("decode-hit").decode_hits(prefill_block_tokens, decode_block_tokens)
            return [prompt for prompt, _ in hits]
        if self.name == "prefill-hit":
            return [
                prompt for prompt, _ in self.prefill_hits(prefill_block_tokens, decode_block_tokens)
            ]
        if self.name == "boundary":
            both = math.lcm(prefill_block_tokens, decode_block_tokens)
            return [
                decode_block_tokens,
                prefill_block_tokens * 2,
                both if both <= 4 * larger else larger,
            ]
        raise ValueError(f"unknown scenario {self.name!r}")

    def prefill_hits(
        self, prefill_block_tokens: int, decode_block_tokens: int
    ) -> list[tuple[int, int]]:
        """(prompt tokens, tokens shared with request 0) per request of the
        "prefill-hit" scenario (#26): requests 1 and 2 begin with request 0's
        first two and first one prefill logical blocks, which prefill's own
        prefix cache hands them (the same block ids, holding request 0's KV);
        decode holds nothing and reads every request whole. Other scenarios
        share nothing."""
        if self.name != "prefill-hit":
            return [(n, 0) for n in self.prompt_tokens(prefill_block_tokens, decode_block_tokens)]
        p, d = prefill_block_tokens, decode_block_tokens
        return [(3 * p + 7, 0), (2 * p + d // 2 + 5, 2 * p), (p + 2 * d + 3, p)]

    def decode_hits(
        self, prefill_block_tokens: int, decode_block_tokens: int
    ) -> list[tuple[int, int]]:
        """(tokens prefill holds, tokens decode's own prefix cache holds) per
        request of the "decode-hit" scenario (#26): a hit is whole decode
        logical blocks; these end inside a prefill logical block, on a block
        boundary of both sides, and one block before the end. "no-hit": the
        same prompts, read whole (what the hits save)."""
        if self.name != "decode-hit":
            return [(n, 0) for n in self.prompt_tokens(prefill_block_tokens, decode_block_tokens)]
        p, d = prefill_block_tokens, decode_block_tokens
        both = math.lcm(p, d)
        inside = next((k * d for k in range(1, 8) if (k * d) % p), d)
        return [
            (inside + 2 * max(p, d) + 5, inside),
            (both + d + 3, both),
            (4 * d + 3, 4 * d),
        ]


@dataclass
class Cell:
    layout: str
    model_dir: str
    p_tp: int
    d_tp: int
    connector: str
    scenarios: list[Scenario]
    num_gpu_blocks: int = 256
    max_model_len: int = 512
    device: str = "cpu"
    # Fault injection (harness/faults.py): another connector or model on the
    # prefill side, or a side-channel port nobody listens on.
    prefill_connector: str | None = None
    prefill_model_dir: str | None = None
    # kill the prefill rank processes before this scenario (after the
    # handshake and the transfers of the earlier ones)
    kill_prefill_before_scenario: int | None = None
    # prefill's lease runs out (and its blocks are reused) before decode reads
    expire_lease: bool = False
    # prefill loses decode's notifications and frees blocks on its lease
    lose_notifications: bool = False
    # both engines run with --enable-prefix-caching
    prefix_caching: bool = False
    # with prefix_caching: kv_connector_extra_config mamba_prefix_caching (False:
    # decode keeps the count rules, and refuses unequal ratios with prefix caching)
    pair_by_position: bool = True
    # with prefix_caching: --mamba-cache-mode of both engines (None: not given,
    # the config hook picks 'align'; 'all': vLLM 0.21.0 only)
    mamba_cache_mode: str | None = None
    # both engines run with the hybrid KV cache manager (False: one KV cache
    # group, as vLLM 0.21.0 runs a dense or sliding-window model with a connector)
    hma: bool = True
    # --block-size of each engine (None: the attention backend's choice)
    prefill_block_size: int | None = None
    decode_block_size: int | None = None
    # after the scenario decode must hold no agent or descriptor list of the
    # prefill engine (it was refused, unreachable or died): any left is leaked
    remote_agents_must_be_gone: bool = False
    # each engine's side-channel address: prefill's is what decode is sent to
    # (a host's own address when the ranks run in network namespaces)
    prefill_host: str = "127.0.0.1"
    decode_host: str = "127.0.0.1"
    # decode engines (each ``d_tp`` ranks) reading from the one prefill engine,
    # as the ranks of a data-parallel decode do: engine k is named as vLLM names
    # DP rank k's engine (``<engine_id>_dp<k>``) and reads requests k, k+n, ...;
    # prefill must be notified of every request, by whichever engine read it
    decode_engines: int = 1

    @property
    def ranks(self) -> int:
        """Rank processes the cell takes: prefill's, then each decode engine's."""
        return self.p_tp + self.decode_engines * self.d_tp


@dataclass
class ScenarioResult:
    name: str
    p_tp: int
    d_tp: int
    layout: str
    local_ratio: int | None = None
    remote_ratio: int | None = None
    requests: int = 0
    slots_checked: int = 0
    mismatched_slots: int = 0
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    # decode's descriptor ids handed to NIXL, and the time its step thread spent
    # in the start_load_kv calls that posted reads (wall and CPU; slowest rank)
    ids_posted: int = 0
    post_ms: float = 0.0
    post_cpu_ms: float = 0.0
    error: str | None = None
    examples: list[str] = field(default_factory=list)
    # Outcome per request, for fault injection.
    requests_failed: int = 0
    silently_wrong_slots: int = 0
    leaked_handles: int = 0
    prefill_released_by_expiry: int = 0
    # vLLM 0.33: prefill engines decode's transfer topology knows after the scenario
    remote_engines_registered: int = 0
    # several decode engines: requests prefill released (notified, or freed by
    # its lease: ``prefill_released_by_expiry`` counts those), of ``requests``
    prefill_released: int | None = None
    # the plugin's per-request records of the batch, summed over decode ranks
    # (``"outcome/reason": requests``), and the bytes of the requests read
    outcomes: dict[str, int] = field(default_factory=dict)
    record_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.mismatched_slots == 0 and self.slots_checked > 0

    def as_json(self) -> dict[str, Any]:
        row = asdict(self)
        for internal in (
            "examples",
            "requests_failed",
            "silently_wrong_slots",
            "leaked_handles",
            "prefill_released_by_expiry",
            "remote_engines_registered",
            "prefill_released",
            "ids_posted",  # benchmarks/run.py reads these three
            "post_ms",
            "post_cpu_ms",
            "outcomes",
            "record_bytes",
        ):
            row.pop(internal)
        return row


_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=256)


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(rng: random.Random | None = None) -> int:
    """A free port on 127.0.0.1 *below* the ephemeral range.

    A port the kernel handed out (bind to port 0) is ephemeral: by the time
    prefill's side-channel listener binds it, a gloo pair or a UCX listener of
    an engine started in between may hold it, and vLLM's scheduler then waits
    forever for a listener thread that died on "Address already in use"
    (seen as a 2 -> 1 cell stalling for minutes). Ports below the ephemeral
    range are never handed out that way.
    """
    rng = rng or random.SystemRandom()
    low, _ = _ephemeral_port_range()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _RECENT_PORTS:  # handed out, maybe not bound yet
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _RECENT_PORTS.append(port)
        return port
    raise RuntimeError("no free port on 127.0.0.1 below the ephemeral range")


class RankPool:
    """Spawned rank processes, each importing vLLM once."""

    def __init__(
        self,
        size: int,
        env: dict[str, str] | None = None,
        namespaces: list[str | None] | None = None,
    ):
        """``env``: extra environment of the rank processes (e.g. UCX_TLS);
        ``namespaces``: per rank process, the network namespace it runs in
        (None: the coordinator's)."""
        self.env = dict(env or {})
        self.namespaces = list(namespaces or [None] * size)
        if len(self.namespaces) != size:
            raise ValueError(f"{len(self.namespaces)} namespaces for {size} rank processes")
        self.connections = []
        self.processes = []
        for index in range(size):
            connection, process = self._spawn(index)
            self.connections.append(connection)
            self.processes.append(process)
        for index in range(size):
            self._receive(index, COMMAND_TIMEOUT_S)

    def _spawn(self, index: int):
        """Start rank process ``index`` with ``self.env`` (and its namespace)
        added to its environment."""
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        env = dict(self.env)
        if self.namespaces[index] is not None:
            env[NETNS_ENV] = self.namespaces[index]
        saved = {name: os.environ.get(name) for name in (*env, NETNS_ENV)}
        os.environ.pop(NETNS_ENV, None)
        os.environ.update(env)  # a spawned child copies the parent's environment
        try:
            process = context.Process(target=rank_main, args=(child,), daemon=True)
            process.start()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        child.close()
        return parent, process

    def _receive(self, index: int, timeout_s: float):
        connection = self.connections[index]
        if not connection.poll(timeout_s):
            raise TimeoutError(f"rank process {index} did not answer in {timeout_s:.0f} s")
        status, reply = connection.recv()
        if status == "error":
            raise RankError(reply)
        return reply

    def kill(self, index: int) -> None:
        """Kill a rank process the hard way (SIGKILL), as a crashed engine dies."""
        self.processes[index].kill()
        self.processes[index].join(timeout=30)

    def respawn(self, index: int) -> None:
        self.connections[index], self.processes[index] = self._spawn(index)
        self._receive(index, COMMAND_TIMEOUT_S)

    def send(self, index: int, command: str, args: dict[str, Any] | None = None) -> None:
        self.connections[index].send((command, args or {}))

    def call_all(
        self, calls: dict[int, tuple[str, dict[str, Any]]], timeout_s: float = COMMAND_TIMEOUT_S
    ) -> dict[int, Any]:
        """Send every call, then collect every reply (errors raise after all replied)."""
        for index, (command, args) in calls.items():
            self.send(index, command, args)
        replies: dict[int, Any] = {}
        first_error: Exception | None = None
        for index in calls:
            try:
                replies[index] = self._receive(index, timeout_s)
            except (RankError, TimeoutError) as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return replies

    def close(self) -> None:
        for connection in self.connections:
            try:
                connection.send(("exit", {}))
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


class RankError(RuntimeError):
    """A command failed inside a rank process (message carries its traceback)."""


@dataclass
class SideBlocks:
    """One request's blocks on one engine, as its scheduler would hand them out."""

    logical_ids_by_group: list[list[int]]
    first_logical_index_by_group: list[int]


def allocate(
    info: dict[str, Any],
    prompt_tokens: list[int],
    rng: random.Random,
    hit_tokens: list[int] | None = None,
) -> list[SideBlocks]:
    """Blocks for every request from one engine's shared HMA pool (block 0 is
    vLLM's null block and never handed out). ``hit_tokens``: decode's own
    prefix-cache hit per request; its attention blocks start after the hit,
    as vLLM hands a connector the blocks that are not cached."""
    free = list(range(1, info["num_logical_blocks"]))
    rng.shuffle(free)
    logical_tokens = info["logical_block_tokens"]
    result = []
    for number, num_tokens in enumerate(prompt_tokens):
        hit_blocks = 0 if hit_tokens is None else hit_tokens[number] // logical_tokens
        logical_count = math.ceil(num_tokens / logical_tokens)
        ids_by_group, first_by_group = [], []
        for kind, window in zip(info["group_kinds"], info["sliding_window_by_group"], strict=True):
            if kind == "mamba":
                ids_by_group.append([free.pop()])
                first_by_group.append(0)
                continue
            ids = [free.pop() for _ in range(logical_count - hit_blocks)]
            if kind == "sliding_window":
                # vLLM's NIXL scheduler keeps cdiv(window, block) + 1 trailing blocks
                ids = ids[-(math.ceil(window / logical_tokens) + 1) :]
            ids_by_group.append(ids)
            first_by_group.append(logical_count - len(ids))
        result.append(SideBlocks(ids_by_group, first_by_group))
    return result


def share_prefixes(
    blocks: list[SideBlocks], info: dict[str, Any], shared_tokens: list[int]
) -> list[SideBlocks]:
    """Prefill's prefix-cache hits: a request sharing its first
    ``shared_tokens`` (whole logical blocks) with request 0 (the owner,
    ``oracle.RequestBlocks.code_request``) gets the owner's block ids for them
    in every full-attention group, as vLLM's prefix cache hands a request the
    cached blocks of its prefix (its own pages for those blocks stay unused).
    Mamba state and sliding-window lists stay the request's own."""
    logical_tokens = info["logical_block_tokens"]
    owner = 0
    for number, shared in enumerate(shared_tokens):
        if not shared:
            continue
        if number == owner or shared % logical_tokens:
            raise ValueError(f"request {number} cannot share {shared} tokens with {owner}")
        count = shared // logical_tokens
        for group, kind in enumerate(info["group_kinds"]):
            if kind == "full_attention":
                ids = blocks[number].logical_ids_by_group[group]
                ids[:count] = blocks[owner].logical_ids_by_group[group][:count]
    return blocks


def run_cell(
    pool: RankPool, cell: Cell, progress: Callable[[str], None], seed: int = 0
) -> list[ScenarioResult]:
    """Set up both engines of a cell on the pool, run its scenarios, tear down."""
    p_ranks = list(range(cell.p_tp))
    d_engines = [
        list(range(cell.p_tp + k * cell.d_tp, cell.p_tp + (k + 1) * cell.d_tp))
        for k in range(cell.decode_engines)
    ]
    d_ranks = [index for ranks in d_engines for index in ranks]
    results = [ScenarioResult(s.name, cell.p_tp, cell.d_tp, cell.layout) for s in cell.scenarios]
    side_channel_port = free_port()
    specs = {}
    engines = [
        (
            "prefill",
            p_ranks,
            f"prefill-{side_channel_port}",
            free_port(),
            cell.prefill_connector or cell.connector,
            cell.prefill_model_dir or cell.model_dir,
            cell.prefill_block_size,
            cell.prefill_host,
        )
    ]
    for k, ranks in enumerate(d_engines):
        engine_id = f"decode-{side_channel_port}"
        if cell.decode_engines > 1:
            engine_id += f"_dp{k}"  # as vLLM names a data-parallel rank's engine
        engines.append(
            (
                "decode",
                ranks,
                engine_id,
                free_port(),
                cell.connector,
                cell.model_dir,
                cell.decode_block_size,
                cell.decode_host,
            )
        )
    for role, ranks, engine_id, dist_port, connector, model_dir, block_size, host in engines:
        for tp_rank, index in enumerate(ranks):
            specs[index] = (
                "setup",
                {
                    "role": role,
                    "engine_id": engine_id,
                    "connector": connector,
                    "model_dir": model_dir,
                    "tp_size": len(ranks),
                    "tp_rank": tp_rank,
                    "dist_port": dist_port,
                    "side_channel_port": side_channel_port if role == "prefill" else free_port(),
                    "num_gpu_blocks": cell.num_gpu_blocks,
                    "max_model_len": cell.max_model_len,
                    "device": cell.device,
                    "enable_prefix_caching": cell.prefix_caching,
                    "mamba_prefix_caching": cell.pair_by_position if cell.prefix_caching else None,
                    "mamba_cache_mode": cell.mamba_cache_mode if cell.prefix_caching else None,
                    "block_size": block_size,
                    "hma": cell.hma,
                    "side_channel_host": host,
                },
            )
    try:
        infos = pool.call_all(specs)
        p_info, d_info = infos[p_ranks[0]], infos[d_ranks[0]]
        for result in results:
            result.remote_ratio = p_info["physical_per_logical"]
            result.local_ratio = d_info["physical_per_logical"]
        payloads = {
            tp_rank: infos[index]["handshake_payload"] for tp_rank, index in enumerate(p_ranks)
        }
        pool.call_all({p_ranks[0]: ("serve_side_channel", {"payloads": payloads})})
        prefill_alive = True
        for number, (scenario, result) in enumerate(zip(cell.scenarios, results, strict=True)):
            if number == cell.kill_prefill_before_scenario:
                for index in p_ranks:
                    pool.kill(index)
                prefill_alive = False
            progress(
                f"{cell.connector} {cell.layout} P_TP={cell.p_tp} D_TP={cell.d_tp} {scenario.name}"
            )
            _run_scenario(
                pool,
                cell,
                scenario,
                result,
                p_ranks if prefill_alive else [],
                d_engines,
                p_info,
                d_info,
                side_channel_port,
                random.Random(seed + number),
            )
    except (RankError, TimeoutError) as e:
        for result in results:
            if result.error is None and result.slots_checked == 0:
                result.error = _first_line(e)
    finally:
        alive = [i for i in p_ranks + d_ranks if pool.processes[i].is_alive()]
        try:
            pool.call_all({index: ("teardown", {}) for index in alive})
        except (RankError, TimeoutError):
            pass
        for index in p_ranks + d_ranks:
            if not pool.processes[index].is_alive():
                pool.respawn(index)
    return results


def _as_sent(
    blocks: SideBlocks,
    num_tokens: int,
    info: dict[str, Any],
    prefix_caching: bool,
    mamba_cache_mode: str | None = None,
) -> list[list[int]]:
    """Prefill's block lists as its scheduler sends them. With prefix caching
    a Mamba group holds one block per logical block, the last holding the
    running state. In Mamba cache mode 'align' the others are vLLM's null
    block (0). In 'all' the blocks of the prompt's last chunk hold the states
    at its block boundaries (vLLM 0.21.0 nulls a request's blocks before its
    running state only at its next step, and a finished prefill has none):
    here real pages of the same request holding other data, which decode
    must not read."""
    from vllm_nixl_hma import _compat

    if not prefix_caching or _compat.adapter() != "v021":  # 0.33 sends the state block only
        return blocks.logical_ids_by_group
    count = math.ceil(num_tokens / info["logical_block_tokens"]) - 1
    padding = [0] * count
    if mamba_cache_mode == "all":
        attention = info["group_kinds"].index(
            next(kind for kind in info["group_kinds"] if kind != "mamba")
        )
        padding = list(blocks.logical_ids_by_group[attention][:count])
    return [
        padding + ids if kind == "mamba" else ids
        for ids, kind in zip(blocks.logical_ids_by_group, info["group_kinds"], strict=True)
    ]


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _records_error(result: ScenarioResult, share_of, d_engines) -> str | None:
    """The plugin's records of a batch that arrived whole (#27): one ``read``
    record per request and decode rank, whose bytes add up to what NIXL moved."""
    expected = sum(len(share_of[ranks[0]]) * len(ranks) for ranks in d_engines)
    if result.outcomes != {"read/none": expected}:
        return f"records: {result.outcomes}, expected {{'read/none': {expected}}}"
    if result.record_bytes != result.bytes:
        return f"records: {result.record_bytes} bytes read, NIXL moved {result.bytes}"
    return None


def _run_scenario(
    pool, cell, scenario, result, p_ranks, d_engines, p_info, d_info, side_channel_port, rng
) -> None:
    """One batch: prefill fills, every decode engine reads its share (request
    i goes to engine i mod n) and checks every slot it holds."""
    d_ranks = [index for ranks in d_engines for index in ranks]
    hits = scenario.decode_hits(p_info["logical_block_tokens"], d_info["logical_block_tokens"])
    prompt_tokens = [prompt for prompt, _ in hits]
    hit_tokens = [hit for _, hit in hits]
    shared_tokens = [
        shared
        for _, shared in scenario.prefill_hits(
            p_info["logical_block_tokens"], d_info["logical_block_tokens"]
        )
    ]
    p_blocks = share_prefixes(allocate(p_info, prompt_tokens, rng), p_info, shared_tokens)
    d_blocks = allocate(d_info, prompt_tokens, rng, hit_tokens)
    batch = f"{scenario.name}-{rng.randrange(1 << 30)}"
    request_ids = [f"{batch}-{i}" for i in range(len(prompt_tokens))]
    result.requests = len(prompt_tokens)

    def oracle_requests(blocks: list[SideBlocks]):
        return [
            {
                "request_index": i,
                "num_tokens": n,
                "logical_ids_by_group": b.logical_ids_by_group,
                # the KV of a prefix shared on prefill is request 0's, on both sides
                "shared_tokens": shared,
            }
            for i, (n, b, shared) in enumerate(
                zip(prompt_tokens, blocks, shared_tokens, strict=True)
            )
        ]

    fill_args = {
        "requests": oracle_requests(p_blocks),
        "first_logical_index_by_group": [b.first_logical_index_by_group for b in p_blocks],
    }
    calls = {index: ("fill", fill_args) for index in p_ranks}
    calls.update({index: ("poison", {}) for index in d_ranks})
    pool.call_all(calls)

    lease_s = SHORT_LEASE_S if cell.expire_lease else LEASE_S
    if scenario.late_read:
        lease_s = lease.DEFAULT_MARGIN_S + LATE_READ_HEADROOM_S
    lease_deadline = lease.lease_deadline(time.time(), lease_s)
    # vLLM 0.33: the same deadline on prefill's perf_counter clock (one host:
    # the coordinator's), as our prefill glue exports it
    lease_expiry_perf = time.perf_counter() + lease_s
    if cell.expire_lease:
        # prefill's lease runs out, it frees the blocks and reuses them for
        # other requests, and only then does decode read
        pool.call_all(
            {
                index: (
                    "serve",
                    {
                        "request_ids": request_ids,
                        "timeout_s": TRANSFER_TIMEOUT_S,
                        "lease_s": lease_s,
                    },
                )
                for index in p_ranks
            }
        )
        reused = {
            **fill_args,
            "requests": [
                dict(r, request_index=r["request_index"] + 100) for r in fill_args["requests"]
            ],
        }
        pool.call_all({index: ("fill", reused) for index in p_ranks})

    load_requests = [
        {
            "request_id": rid,
            "local_logical_ids_by_group": d.logical_ids_by_group,
            # as NixlHMAConnector.build_connector_meta hands it to its workers
            "token_span": (hit, n),
            "kv_transfer_params": {
                "remote_block_ids": _as_sent(
                    p, n, p_info, cell.prefix_caching, cell.mamba_cache_mode
                ),
                "remote_engine_id": f"prefill-{side_channel_port}",
                "remote_request_id": rid,
                "remote_host": cell.prefill_host,
                "remote_port": free_port() if scenario.dead_side_channel else side_channel_port,
                "tp_size": cell.p_tp,
                # what prefill's request_finished reports it holds (vLLM 0.33 and
                # 0.34 read it; 0.34 pairs unequal block sizes by it)
                "remote_num_tokens": n,
                # as NixlHMAConnector.request_finished_all_groups adds on prefill
                lease.PARAM: lease_deadline,
                "remote_blocks_expiry_time": lease_expiry_perf,
            },
        }
        for rid, p, d, n, hit in zip(
            request_ids, p_blocks, d_blocks, prompt_tokens, hit_tokens, strict=True
        )
    ]
    if scenario.bad_span_first_request:
        hit, tokens = load_requests[0]["token_span"]
        load_requests[0]["token_span"] = (
            hit,
            tokens + scenario.bad_span_blocks * p_info["logical_block_tokens"],
        )
    if scenario.unpairable_first_request:
        params = load_requests[0]["kv_transfer_params"]
        attention = p_info["group_kinds"].index(
            next(kind for kind in p_info["group_kinds"] if kind != "mamba")
        )
        params["remote_block_ids"] = [list(ids) for ids in params["remote_block_ids"]]
        params["remote_block_ids"][attention] = params["remote_block_ids"][attention][:1]
    serving = [] if cell.expire_lease else p_ranks
    serve_args: dict[str, Any] = {"request_ids": request_ids, "timeout_s": TRANSFER_TIMEOUT_S}
    if cell.lose_notifications:
        serve_args.update(lease_s=LOST_NOTIFICATION_LEASE_S, drop_notifications=True)
    for index in serving:
        pool.send(index, "serve", serve_args)
    load_args: dict[str, Any] = {"requests": load_requests, "timeout_s": TRANSFER_TIMEOUT_S}
    if scenario.late_read:
        # decode's "too late" starts lease_margin_s before the lease end
        load_args["first_poll_at_wall_s"] = (
            lease_deadline - lease.DEFAULT_MARGIN_S + LATE_READ_POLL_AFTER_S
        )
    for k, ranks in enumerate(d_engines):
        share = {**load_args, "requests": load_requests[k :: len(d_engines)]}
        for index in ranks:
            pool.send(index, "load", share)
    if scenario.kill_prefill_after_s is not None:
        time.sleep(scenario.kill_prefill_after_s)
        for index in p_ranks:
            pool.kill(index)
        serving = []
    load_error = None
    loads = {}
    for index in d_ranks:
        try:
            loads[index] = pool._receive(index, COMMAND_TIMEOUT_S)
        except RankError as e:
            load_error = load_error or e
    # else prefill serves until its lease frees the blocks; with several decode
    # engines it serves until it released every request (the proof)
    if not cell.lose_notifications and len(d_engines) == 1:
        for index in serving:
            pool.send(index, "abort")
    prefill_ours = (cell.prefill_connector or cell.connector) == "NixlHMAConnector"
    for index in serving:
        served = pool._receive(index, COMMAND_TIMEOUT_S)
        result.prefill_released_by_expiry += served["released_by_expiry"]
        # one prefill record per request freed, saying how (#27)
        freed = served["prefill_freed"]
        if prefill_ours and (
            freed["lease"] != served["released_by_expiry"]
            or freed["notified"] + freed["lease"] != len(served["notified"])
        ):
            result.error = result.error or (
                f"prefill rank {index} records: {freed}, but it freed {len(served['notified'])} "
                f"requests, {served['released_by_expiry']} by its lease"
            )
        if len(d_engines) > 1:
            notified = len(set(served["notified"]) & set(request_ids))
            if result.prefill_released is None or notified < result.prefill_released:
                result.prefill_released = notified  # the least any prefill rank saw
    if load_error is not None:
        result.error = _first_line(load_error)
        return
    if scenario.late_read and not all(load["posted_before_poll"] for load in loads.values()):
        # refused at the start instead: the late-read path was not reached
        result.error = "the reads were not all posted inside the lease; no late read happened"
        return
    failed = {rid for load in loads.values() for rid in load["failed"]}
    # each decode rank loads its engine's share of the requests
    share_of = {
        index: set(request_ids[k :: len(d_engines)])
        for k, ranks in enumerate(d_engines)
        for index in ranks
    }
    not_done = {
        rid for index, load in loads.items() for rid in share_of[index] - set(load["done"])
    } - failed
    # A request counts as failed for vLLM only if every block of it was
    # reported invalid: that is what makes the scheduler fail or recompute it.
    invalid = {b for load in loads.values() for b in load["invalid_block_ids"]}
    reported_failed = {
        rid
        for rid, blocks in zip(request_ids, d_blocks, strict=True)
        if {b for group in blocks.logical_ids_by_group for b in group} <= invalid
    }
    # vLLM 0.33 reports failed requests as such (failed_recving)
    reported_failed |= {rid for load in loads.values() for rid in load.get("failed_reported", [])}
    result.requests_failed = len(reported_failed)
    result.remote_engines_registered = max(
        (load.get("remote_engines_registered", 0) for load in loads.values()), default=0
    )
    failed |= reported_failed  # a failed transfer ends as "received" upstream

    if not_done:
        result.error = f"{len(not_done)} request(s) not finished in {TRANSFER_TIMEOUT_S:.0f} s"
    elif failed:
        result.error = f"{len(failed)} request(s) reported failed by the connector"
    result.seconds = max(load["seconds"] for load in loads.values())
    result.bytes = sum(load["bytes"] for load in loads.values())
    result.descriptors = sum(load["descriptors"] for load in loads.values())
    for load in loads.values():
        for key, count in load["outcomes"].items():
            result.outcomes[key] = result.outcomes.get(key, 0) + count
        result.record_bytes += load["record_bytes"]
    if result.error is None and cell.connector == "NixlHMAConnector":
        result.error = _records_error(result, share_of, d_engines)
    result.ids_posted = sum(load["ids_posted"] for load in loads.values())
    result.post_ms = max(load["post_seconds"] for load in loads.values()) * 1e3
    result.post_cpu_ms = max(load["post_cpu_seconds"] for load in loads.values()) * 1e3
    result.leaked_handles = sum(load["pending_transfers"] for load in loads.values())
    if cell.remote_agents_must_be_gone:
        result.leaked_handles += sum(
            load["remote_agents"] + load["remote_dlists"] for load in loads.values()
        )

    everyone = oracle_requests(d_blocks)
    first_indices = [b.first_logical_index_by_group for b in d_blocks]
    calls = {}
    for k, ranks in enumerate(d_engines):
        share = slice(k, None, len(d_engines))
        verify_args = {
            "requests": everyone[share],
            "first_logical_index_by_group": first_indices[share],
        }
        calls.update({index: ("verify", verify_args) for index in ranks})
    verdicts = pool.call_all(calls)
    # vLLM decodes every finished request whose blocks were not all reported invalid
    delivered = {i for i, rid in enumerate(request_ids) if rid not in reported_failed | not_done}
    for verdict in verdicts.values():
        result.slots_checked += verdict.slots_checked
        result.mismatched_slots += verdict.mismatched_slots
        result.examples.extend(verdict.examples[: 5 - len(result.examples)])
        result.silently_wrong_slots += sum(
            count
            for request_index, count in verdict.mismatched_by_request.items()
            if request_index in delivered or request_index == -1
        )


def model_dir_for(config: dict[str, Any], root: Path) -> str:
    """Write an embedded config.json to a directory both engines share."""
    import json

    directory = Path(tempfile.mkdtemp(prefix="model-", dir=root))
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def run_cells(
    cells: list[Cell],
    progress: Callable[[str], None],
    env: dict[str, str] | None = None,
    namespaces: list[str | None] | None = None,
) -> list[ScenarioResult]:
    """``env``: extra environment of the rank processes (e.g. their log file);
    ``namespaces``: the network namespace of each rank process (prefill's
    ranks come first in every cell), as ``RankPool`` takes them."""
    size = max(cell.ranks for cell in cells)
    started = time.perf_counter()
    pool = RankPool(size, env, namespaces)
    progress(f"{size} rank processes ready in {time.perf_counter() - started:.1f} s")
    results: list[ScenarioResult] = []
    # a model whose cache cannot be built is refused once, not once per cell
    refused: dict[str, str] = {}
    try:
        for cell in cells:
            if cell.model_dir in refused:
                cell_results = [
                    ScenarioResult(s.name, cell.p_tp, cell.d_tp, cell.layout)
                    for s in cell.scenarios
                ]
                for result in cell_results:
                    result.error = refused[cell.model_dir]
            else:
                cell_results = run_cell(pool, cell, progress)
                errors = {result.error or "" for result in cell_results}
                if len(errors) == 1 and errors.pop().startswith(UNSUPPORTED_ARCHITECTURE):
                    refused[cell.model_dir] = cell_results[0].error or ""
                    progress(refused[cell.model_dir])
            results.extend(cell_results)
    finally:
        pool.close()
    return results

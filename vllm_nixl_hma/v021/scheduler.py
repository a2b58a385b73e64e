"""Schedulers that can fail or recompute requests of hybrid models whose KV did not arrive.

vLLM 0.21.0's ``Scheduler._update_requests_with_invalid_blocks`` unpacks a
request's block ids as a single KV cache group, so with HMA (several groups)
any reported invalid block raises, and connectors report none: a request
whose KV never arrived decodes on garbage (vLLM issue #52234). These
subclasses handle several groups; the rest of vLLM's failure policy
(``kv_load_failure_policy``: ``fail`` finishes the request with an error,
``recompute`` computes it locally) is upstream's.

The config hook selects ``make_scheduler`` as ``scheduler_cls`` for
NixlHMAConnector: a factory, because whether vLLM schedules asynchronously is
decided after the hook runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_nixl_hma.core import resume, upstream_contract
from vllm_nixl_hma.core.positions import NULL_BLOCK_ID  # vLLM's null block: never invalid

__all__ = [
    "FACTORY_PATH",
    "NixlHMAAsyncScheduler",
    "NixlHMAScheduler",
    "handles_multi_group_failures",
    "make_scheduler",
]

FACTORY_PATH = "vllm_nixl_hma.v021.scheduler.make_scheduler"


class HybridInvalidBlocksMixin:
    """Override of ``Scheduler._update_requests_with_invalid_blocks`` for
    several KV cache groups.

    Why: upstream's ``(req_block_ids,) = get_block_ids(req_id)`` raises for a
    hybrid model; and with one sliding-window group (a model whose every
    layer is sliding-window, which vLLM runs as one group with a connector)
    upstream resumes a failed request at its first invalid block, which is
    the first block of the window: the window's start then lies in the null
    blocks vLLM put before it, and under ``recompute`` the request decoded
    on KV nobody computed and left those wrong blocks in the prefix cache
    (issue #41). What changes, for more than one group: a request is
    affected when any of its blocks in any group is invalid; its computed
    tokens drop to 0 (a Mamba state cannot be resumed from a partial prefix,
    and P/D hybrids run without prefix caching), and with ``evict_blocks``
    all its blocks are evicted. One group: upstream's method, then an
    affected request whose resume point needs a block it does not hold
    (``core.resume``) resumes at 0, its blocks evicted with
    ``evict_blocks``. Remove when: upstream handles several groups and
    checks the window at its resume point.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        contract = upstream_contract.V021
        upstream_contract.require(
            Scheduler,
            contract.scheduler_overrides,
            owner_name="Scheduler",
            release=contract.release,
        )
        contract.require_signatures(Scheduler, "scheduler", contract.scheduler_overrides)
        super().__init__(*args, **kwargs)
        contract.require_state(self, contract.scheduler_state, Scheduler, "its constructor")
        for manager in self.kv_cache_manager.coordinator.single_type_managers:
            upstream_contract.require(
                manager,
                contract.group_manager_state,
                owner_name=type(manager).__name__,
                release=contract.release,
            )

    def _update_requests_with_invalid_blocks(
        self,
        requests: Iterable[Any],
        invalid_block_ids: set[int],
        num_scheduled_tokens: dict[str, int],
        evict_blocks: bool = True,
    ) -> tuple[set[str], int, set[int]]:
        if len(self.kv_cache_config.kv_cache_groups) <= 1:
            requests = list(requests)  # upstream's callers may pass a generator
            affected, tokens, blocks_to_evict = super()._update_requests_with_invalid_blocks(
                requests, invalid_block_ids, num_scheduled_tokens, evict_blocks
            )
            tokens += self._resume_where_context_is_held(
                (r for r in requests if r.request_id in affected), blocks_to_evict, evict_blocks
            )
            return affected, tokens, blocks_to_evict
        affected_request_ids: set[str] = set()
        affected_tokens = 0
        blocks_to_evict: set[int] = set()
        for request in requests:
            block_ids_by_group = self.kv_cache_manager.get_block_ids(request.request_id)
            request_block_ids = {
                block_id
                for group in block_ids_by_group
                for block_id in group
                if block_id != NULL_BLOCK_ID
            }
            if request_block_ids.isdisjoint(invalid_block_ids):
                continue
            computed_tokens = request.num_computed_tokens - num_scheduled_tokens.get(
                request.request_id, 0
            )
            affected_tokens += max(computed_tokens, 0)
            request.num_computed_tokens = 0
            affected_request_ids.add(request.request_id)
            if evict_blocks:
                blocks_to_evict |= request_block_ids
        return affected_request_ids, affected_tokens, blocks_to_evict

    def _resume_where_context_is_held(
        self, affected: Iterable[Any], blocks_to_evict: set[int], evict_blocks: bool
    ) -> int:
        """Move each affected request of one KV cache group whose resume
        point needs a block it does not hold back to token 0 (the tokens
        this adds to recompute are returned); its blocks join
        ``blocks_to_evict`` with ``evict_blocks``."""
        (manager,) = self.kv_cache_manager.coordinator.single_type_managers
        block_tokens = manager.block_size
        added_tokens = 0
        for request in affected:
            resume_at = request.num_computed_tokens
            (block_ids,) = self.kv_cache_manager.get_block_ids(request.request_id)
            kept = resume.resume_tokens(
                block_ids, manager.get_num_skipped_tokens(resume_at), resume_at, block_tokens
            )
            if kept == resume_at:
                continue
            added_tokens += resume_at - kept
            request.num_computed_tokens = kept
            if evict_blocks:
                blocks_to_evict.update(b for b in block_ids if b != NULL_BLOCK_ID)
        return added_tokens


class AsyncLoadsInAlignModeMixin:
    """vLLM 0.21.0's ``Scheduler.schedule``, able to park a request whose KV
    the connector loads, in Mamba cache mode ``align``.

    Why: in that mode upstream calls ``_mamba_block_aligned_split`` for every
    waiting request it places, a request the connector loads asynchronously
    too, and that method asserts "External KV connector is not verified yet"
    (were it not to, it would return 0 tokens, on which ``schedule`` stops
    placing requests for the step): a decode engine of a Mamba hybrid with
    prefix caching (``mamba_prefix_caching``) went down on its first P/D
    request. What changes: when the connector has just answered that the
    request it was asked about loads asynchronously, the next read of
    ``need_mamba_block_aligned_split`` (the one that guards that call) says
    False, so upstream allocates the request's blocks and parks it as in
    every other mode; any other read, and so the split of every chunk the
    engine computes itself, is upstream's. The request then computes one
    token per step (its last prompt token, then its output), which the split
    leaves alone. Remove when: vLLM 0.33 is the minimum (its scheduler places
    asynchronous loads before the split).
    """

    #: set by the connector's answer, cleared by the next read and each step
    _async_load_answered = False
    _aligned_split = False

    @property
    def need_mamba_block_aligned_split(self) -> bool:
        if self._async_load_answered:
            self._async_load_answered = False
            return False
        return self._aligned_split

    @need_mamba_block_aligned_split.setter
    def need_mamba_block_aligned_split(self, value: bool) -> None:
        self._aligned_split = bool(value)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        connector = getattr(self, "connector", None)
        if connector is None or not self._aligned_split:
            return
        answer = connector.get_num_new_matched_tokens

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int):
            count, load_async = answer(request, num_computed_tokens)
            self._async_load_answered = bool(load_async)
            return count, load_async

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens

    def schedule(self, *args: Any, **kwargs: Any):
        self._async_load_answered = False
        return super().schedule(*args, **kwargs)


class NixlHMAScheduler(HybridInvalidBlocksMixin, AsyncLoadsInAlignModeMixin, Scheduler):
    """vLLM's Scheduler, able to fail or recompute hybrid requests."""


class NixlHMAAsyncScheduler(HybridInvalidBlocksMixin, AsyncLoadsInAlignModeMixin, AsyncScheduler):
    """vLLM's AsyncScheduler, able to fail or recompute hybrid requests."""


def make_scheduler(*args: Any, vllm_config: Any, **kwargs: Any) -> Scheduler:
    """What vLLM's engine core calls as ``scheduler_cls``: our subclass of the
    scheduler vLLM would have picked (async or not, known only by now)."""
    cls = (
        NixlHMAAsyncScheduler if vllm_config.scheduler_config.async_scheduling else NixlHMAScheduler
    )
    return cls(*args, vllm_config=vllm_config, **kwargs)


def handles_multi_group_failures(scheduler_cls: object) -> bool:
    """Whether vLLM's configured ``scheduler_cls`` can fail or recompute a
    request of several KV cache groups: our factory, or any class built on
    ``HybridInvalidBlocksMixin``, whether configured as an object or as its
    qualified name (``module.attr``). Judged by the object, not the string: a
    user who names ``vllm_nixl_hma.v021.scheduler.NixlHMAScheduler`` or a subclass
    of their own keeps failing closed."""
    target = scheduler_cls
    if isinstance(scheduler_cls, str):
        import importlib

        module_name, _, attribute = scheduler_cls.rpartition(".")
        try:
            target = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError, ValueError):
            return False
    if target is make_scheduler:
        return True
    return isinstance(target, type) and issubclass(target, HybridInvalidBlocksMixin)

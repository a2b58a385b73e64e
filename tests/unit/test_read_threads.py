"""``read_threads``: the split our agents ask NIXL for, and how an agent is built."""

from __future__ import annotations

import types

import pytest

from vllm_nixl_hma.core import read_threads
from vllm_nixl_hma.core.read_threads import DEFAULT_SPLIT_BATCH_SIZE, split_batch_size_from
from vllm_nixl_hma.v021.worker import build_nixl_agent


@pytest.mark.parametrize("extra_config", [None, {}, {"num_threads": 8}])
def test_the_default_split_when_the_user_sets_none(extra_config):
    assert split_batch_size_from(extra_config) == DEFAULT_SPLIT_BATCH_SIZE


@pytest.mark.parametrize(("value", "count"), [(1, 1), (64, 64), ("128", 128), (" 16 ", 16)])
def test_a_whole_number_of_descriptors_is_taken(value, count):
    assert split_batch_size_from({"split_batch_size": value}) == count


@pytest.mark.parametrize("value", [0, -4, True, 2.5, "abc", "", None, [32]])
def test_anything_else_is_refused_naming_key_and_value(value):
    with pytest.raises(ValueError) as error:
        split_batch_size_from({"split_batch_size": value})
    assert f"split_batch_size={value!r}" in str(error.value)


def test_ucx_parameters_are_nixl_strings():
    assert read_threads.ucx_backend_params(4, 32) == {
        "num_threads": "4",
        "split_batch_size": "32",
    }
    with pytest.raises(ValueError, match="num_threads=0"):
        read_threads.ucx_backend_params(0, 32)


class RecordingAgent:
    """Stands in for ``nixl_agent``: records how it was built."""

    def __init__(self, name, config):
        self.name = name
        self.config = config
        self.backends = {} if config is None else {b: {} for b in config.backends}

    def create_backend(self, backend, params):
        self.backends[backend] = params


def config(backends=("UCX",), num_threads=4):
    return types.SimpleNamespace(
        backends=list(backends), num_threads=num_threads, capture_telemetry=True
    )


def test_an_agent_with_ucx_threads_gets_the_split_and_keeps_the_rest_of_its_config():
    asked = config()
    agent = build_nixl_agent(RecordingAgent, "a", asked, 16)
    assert agent.backends == {"UCX": {"num_threads": "4", "split_batch_size": "16"}}
    assert agent.config.capture_telemetry is True and agent.config.num_threads == 4
    assert asked.backends == ["UCX"]  # the caller's config is left as it was


@pytest.mark.parametrize(
    "asked",
    [None, config(num_threads=0), config(backends=("UCX", "GDS")), config(backends=("GDS",))],
    ids=["no config", "no UCX threads", "UCX and another backend", "no UCX"],
)
def test_any_other_agent_is_built_exactly_as_asked(asked):
    agent = build_nixl_agent(RecordingAgent, "a", asked, 16)
    assert agent.config is asked
    assert all(params == {} for params in agent.backends.values())


class AgentWithoutBackends:
    """A ``NixlWrapper`` stand-in as vLLM 0.21.0's own NIXL tests write them:
    built from name and config, no ``create_backend``."""

    def __init__(self, name, config):
        self.config = config


def test_an_agent_that_cannot_add_backends_is_built_as_upstream_builds_it():
    asked = config()
    agent = build_nixl_agent(AgentWithoutBackends, "a", asked, 16)
    assert agent.config is asked and asked.backends == ["UCX"]

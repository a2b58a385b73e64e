"""``progress_thread``: the setting, and the agent built with it (stand-in
bindings; real NIXL agents in tests/integration/test_progress_thread_live.py)."""

from __future__ import annotations

import sys
import types

import pytest

from vllm_nixl_hma.core.progress_thread import (
    EXTRA_CONFIG_KEY,
    agents_built_with_delay,
    delay_us_from,
)


def test_absent_means_nixls_own():
    assert delay_us_from(None) is None
    assert delay_us_from({}) is None
    assert delay_us_from({"split_batch_size": 8}) is None


@pytest.mark.parametrize(("value", "delay_us"), [(0, 0), (1000, 1000), ("250", 250)])
def test_whole_microseconds(value, delay_us):
    assert delay_us_from({EXTRA_CONFIG_KEY: value}) == delay_us


@pytest.mark.parametrize("value", [True, 1.5, "1ms", -1, 10_000_000, ""])
def test_anything_else_is_refused_naming_key_and_value(value):
    with pytest.raises(ValueError, match=f"progress_thread_delay_us={value!r}"):
        delay_us_from({EXTRA_CONFIG_KEY: value})


@pytest.fixture
def stand_in_nixl(monkeypatch):
    """A module shaped like NIXL's ``_api``: a class that builds its agent
    through the module's ``nixlBind.nixlAgent``, as ``nixl_agent`` does."""
    module = types.ModuleType("stand_in_nixl_api")
    built = []

    class Config:
        pthrDelay = 0

    def nixl_agent_binding(name, config):
        built.append((name, config.pthrDelay))
        return object()

    module.nixlBind = types.SimpleNamespace(nixlAgent=nixl_agent_binding)

    class Agent:
        def __init__(self, name):
            config = Config()
            config.pthrDelay = 0  # as NIXL's Python API sets it
            self.agent = module.nixlBind.nixlAgent(name, config)

    Agent.__module__ = module.__name__
    module.Agent = Agent
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module, built


def test_an_agent_built_inside_gets_the_delay_and_the_bindings_are_put_back(stand_in_nixl):
    module, built = stand_in_nixl
    binding = module.nixlBind.nixlAgent
    with agents_built_with_delay(module.Agent, 1000) as applied:
        module.Agent("inside")
    module.Agent("after")
    assert applied
    assert built == [("inside", 1000), ("after", 0)]
    assert module.nixlBind.nixlAgent is binding


def test_the_bindings_are_put_back_when_building_fails(stand_in_nixl):
    module, _ = stand_in_nixl
    binding = module.nixlBind.nixlAgent
    with pytest.raises(RuntimeError, match="no UCX"):
        with agents_built_with_delay(module.Agent, 1000):
            raise RuntimeError("no UCX")
    assert module.nixlBind.nixlAgent is binding


def test_without_a_delay_or_bindings_nothing_is_touched(stand_in_nixl):
    module, built = stand_in_nixl
    binding = module.nixlBind.nixlAgent
    with agents_built_with_delay(module.Agent, None) as applied:
        module.Agent("unset")
    assert not applied and module.nixlBind.nixlAgent is binding
    assert built == [("unset", 0)]

    class WithoutBindings:  # vLLM's own tests' wrappers are like this
        pass

    with agents_built_with_delay(WithoutBindings, 1000) as applied:
        pass
    assert not applied

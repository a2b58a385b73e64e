"""The configuration hook on real VllmConfigs built from tiny shipped configs.

tests/fixtures/tiny_hybrid is a Bamba (attention + Mamba2) config.json and
tests/fixtures/tiny_dense a Llama one: no weights, no network. The hook is
installed the way vLLM installs it, by calling the plugin entry point.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.platforms import current_platform

from vllm_nixl_hma import plugin
from vllm_nixl_hma.v021 import config_hook

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
HYBRID = FIXTURES / "tiny_hybrid"
DENSE = FIXTURES / "tiny_dense"


@pytest.fixture(autouse=True)
def installed_plugin():
    plugin.register()
    plugin.register()  # vLLM may load plugins several times per process


def build_config(
    model_dir: Path,
    connector: str | None,
    enable_prefix_caching: bool = True,
    disable_hybrid_kv_cache_manager: bool | None = None,
    extra_config: dict | None = None,
    mamba_cache_mode: str = "none",
    enable_chunked_prefill: bool = True,
) -> VllmConfig:
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=1024)
    kv_transfer_config = (
        KVTransferConfig(
            kv_connector=connector,
            kv_role="kv_consumer",
            kv_connector_extra_config=extra_config or {},
        )
        if connector
        else None
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            enable_prefix_caching=enable_prefix_caching, mamba_cache_mode=mamba_cache_mode
        ),
        device_config=DeviceConfig("cpu"),
        scheduler_config=SchedulerConfig.default_factory(
            max_model_len=1024,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        kv_transfer_config=kv_transfer_config,
    )


OPT_IN = {"mamba_prefix_caching": True}


def test_opted_in_hybrid_keeps_prefix_caching_in_align_mode(mocker):
    """Without the hook vLLM 0.21.0 picks 'all' for this model (checked below
    under stock), which would cache boundary states decode never received."""
    warning = mocker.spy(config_hook.logger, "warning")
    config = build_config(HYBRID, "NixlHMAConnector", extra_config=OPT_IN)
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.mamba_cache_mode == "align"
    assert not [c for c in warning.call_args_list if "NixlHMAConnector" in c.args[0]]
    stock = build_config(HYBRID, "NixlConnector", extra_config=OPT_IN)
    assert stock.cache_config.mamba_cache_mode == "all"


@pytest.mark.parametrize("text", ["true", " TRUE "])
def test_opt_in_given_as_text_counts(text):
    config = build_config(HYBRID, "NixlHMAConnector", extra_config={"mamba_prefix_caching": text})
    assert config.cache_config.enable_prefix_caching is True


def test_opt_in_turns_prefix_caching_on():
    config = build_config(
        HYBRID, "NixlHMAConnector", enable_prefix_caching=False, extra_config=OPT_IN
    )
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.mamba_cache_mode == "align"


@pytest.mark.parametrize("chunked_prefill", [True, False])
def test_opt_in_keeps_an_explicit_mamba_cache_mode_all_where_vllm_supports_it(chunked_prefill):
    """Bamba: vLLM 0.21.0 caches its state at every block boundary in 'all',
    which needs no chunked prefill (only 'align' does)."""
    config = build_config(
        HYBRID,
        "NixlHMAConnector",
        extra_config=OPT_IN,
        mamba_cache_mode="all",
        enable_chunked_prefill=chunked_prefill,
    )
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.mamba_cache_mode == "all"


def test_mamba_cache_mode_all_is_refused_for_a_model_vllm_cannot_cache_that_way():
    """Qwen3-Next: vLLM 0.21.0 has no 'all' for it (it would fall back to
    'align' by itself); the hook says so at startup."""
    qwen3_next = FIXTURES / "architectures" / "qwen3_next"
    assert not ModelConfig(
        model=str(qwen3_next), skip_tokenizer_init=True
    ).supports_mamba_prefix_caching
    with pytest.raises(ValueError, match="--mamba-cache-mode all.*cannot cache"):
        build_config(qwen3_next, "NixlHMAConnector", mamba_cache_mode="all")


def test_opt_in_refuses_chunked_prefill_off_naming_it():
    with pytest.raises(ValueError, match="chunked prefill"):
        build_config(HYBRID, "NixlHMAConnector", extra_config=OPT_IN, enable_chunked_prefill=False)


@pytest.mark.parametrize("value", [1, "yes", None, [True]])
def test_a_bad_opt_in_value_stops_startup_naming_the_key(value):
    with pytest.raises(ValueError, match="mamba_prefix_caching"):
        build_config(HYBRID, "NixlHMAConnector", extra_config={"mamba_prefix_caching": value})


def test_fixture_models_are_what_the_tests_assume():
    assert ModelConfig(model=str(HYBRID), skip_tokenizer_init=True).is_hybrid
    assert not ModelConfig(model=str(DENSE), skip_tokenizer_init=True).is_hybrid


def test_hybrid_whose_operator_said_no_gets_prefix_caching_off_and_mamba_mode_none(mocker):
    warning = mocker.spy(config_hook.logger, "warning")
    config = build_config(
        HYBRID,
        "NixlHMAConnector",
        enable_prefix_caching=True,
        extra_config={"mamba_prefix_caching": False},
    )
    assert config.cache_config.enable_prefix_caching is False
    assert config.cache_config.mamba_cache_mode == "none"
    # One warning line that says what changed, why, and how to silence it.
    ours = [c for c in warning.call_args_list if "NixlHMAConnector" in c.args[0]]
    assert len(ours) == 1
    message = ours[0].args[0] % ours[0].args[1:]
    assert "prefix caching turned OFF" in message
    assert "mamba_prefix_caching is false" in message
    assert "--no-enable-prefix-caching" in message
    assert "BambaForCausalLM" in message


def test_an_explicit_enable_prefix_caching_is_kept_in_align_mode():
    """vLLM 0.21.0's engine arguments leave prefix caching off for hybrids
    unless --enable-prefix-caching is given: on here, the operator asked."""
    config = build_config(HYBRID, "NixlHMAConnector", enable_prefix_caching=True)
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.mamba_cache_mode == "align"


def test_hybrid_with_prefix_caching_already_off_gets_no_warning(mocker):
    warning = mocker.spy(config_hook.logger, "warning")
    config = build_config(HYBRID, "NixlHMAConnector", enable_prefix_caching=False)
    assert config.cache_config.mamba_cache_mode == "none"
    warning.assert_not_called()


def test_hybrid_under_stock_nixl_connector_is_unchanged():
    config = build_config(HYBRID, "NixlConnector", enable_prefix_caching=True)
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.mamba_cache_mode != "none"


def test_dense_model_under_our_connector_is_unchanged():
    config = build_config(DENSE, "NixlHMAConnector", enable_prefix_caching=True)
    assert config.cache_config.enable_prefix_caching is True


def test_module_path_spelling_selects_the_hook_too():
    model_config = ModelConfig(model=str(HYBRID), skip_tokenizer_init=True, max_model_len=1024)
    config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlHMAConnector",
            kv_connector_module_path="vllm_nixl_hma",
            kv_role="kv_consumer",
            kv_connector_extra_config={"mamba_prefix_caching": False},
        ),
    )
    assert config.cache_config.enable_prefix_caching is False


def test_hma_is_enabled_without_the_flag_where_the_platform_supports_it(mocker):
    mocker.patch.object(current_platform, "support_hybrid_kv_cache", return_value=True)
    ours = build_config(HYBRID, "NixlHMAConnector")
    assert ours.scheduler_config.disable_hybrid_kv_cache_manager is False
    # Without the hook, vLLM 0.21.0 turns HMA off because a connector is set.
    stock = build_config(HYBRID, "NixlConnector")
    assert stock.scheduler_config.disable_hybrid_kv_cache_manager is True


def test_hma_is_left_to_vllm_where_the_platform_lacks_it():
    assert not current_platform.support_hybrid_kv_cache()  # this CPU-only machine
    config = build_config(HYBRID, "NixlHMAConnector")
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True


def test_explicit_hma_disable_is_refused_at_startup_naming_the_flag():
    # pydantic wraps the hook's ConfigHookError (a ValueError) in its ValidationError.
    with pytest.raises(ValueError, match="needs the hybrid KV cache manager") as info:
        build_config(HYBRID, "NixlHMAConnector", disable_hybrid_kv_cache_manager=True)
    assert "--disable-hybrid-kv-cache-manager" in str(info.value)


def test_install_is_idempotent():
    first = VllmConfig.try_verify_and_update_config
    config_hook.install()
    config_hook.install()
    assert VllmConfig.try_verify_and_update_config is first


def test_our_connector_gets_the_scheduler_factory_stock_does_not():
    from vllm_nixl_hma.v021.scheduler import FACTORY_PATH

    assert build_config(DENSE, "NixlHMAConnector").scheduler_config.scheduler_cls == FACTORY_PATH
    assert build_config(HYBRID, "NixlHMAConnector").scheduler_config.scheduler_cls == FACTORY_PATH
    assert build_config(HYBRID, "NixlConnector").scheduler_config.scheduler_cls is None


def test_a_users_own_scheduler_class_is_kept():
    model_config = ModelConfig(model=str(HYBRID), skip_tokenizer_init=True, max_model_len=1024)
    config = VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig("cpu"),
        scheduler_config=SchedulerConfig.default_factory(
            max_model_len=1024, scheduler_cls="my.own.Scheduler"
        ),
        kv_transfer_config=KVTransferConfig(kv_connector="NixlHMAConnector", kv_role="kv_both"),
    )
    assert config.scheduler_config.scheduler_cls == "my.own.Scheduler"

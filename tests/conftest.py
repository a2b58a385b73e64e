"""Shared test set-up: hypothesis profiles and a quiet, offline vLLM."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Before anything imports vLLM: no hub lookups, DS conv layout as P/D needs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

settings.register_profile(
    "dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci",
    max_examples=1000,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

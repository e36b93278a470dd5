"""Budgets of the fuzz properties: a short one in `make test` (each property a few hundred examples), a
long one in `make fuzz` (HSX_FUZZ=long). A failing example Hypothesis finds is printed; put it in the
property's corpus (an @example) so it stays a test."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]}
settings.register_profile("hsx-short", max_examples=150, **_COMMON)
settings.register_profile("hsx-long", max_examples=20_000, **_COMMON)
settings.load_profile("hsx-long" if os.environ.get("HSX_FUZZ") == "long" else "hsx-short")

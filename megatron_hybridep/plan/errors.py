"""The one exception type of plan/: every validation failure names the field and the fix."""

from __future__ import annotations


class PlanError(ValueError):
    """Invalid topology, workload or plan. The message names the offending field and how to fix it."""

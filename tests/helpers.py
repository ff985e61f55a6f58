"""Small helpers shared by tests in several folders."""

from __future__ import annotations

import argparse
import copy
from typing import Any


def with_args(base: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    """A copy of parsed arguments with some of them changed (``base`` itself is left alone)."""
    a = copy.copy(base)
    for k, v in changes.items():
        setattr(a, k, v)
    return a

"""Fixtures for the testbed tests: root check and unique prefixes that are cleaned up."""

from __future__ import annotations

import itertools
import os

import pytest
from testbed_helpers import why_not_root_capable

from megatron_hybridep.testbed import netns

_counter = itertools.count()


@pytest.fixture
def root_host():
    """Skip unless this process may build namespaces (CI runs these as root)."""
    why = why_not_root_capable()
    if why:
        pytest.skip(why)


@pytest.fixture
def prefix(root_host):
    """A testbed prefix unique to this test; whatever is left under it is removed afterwards."""
    p = f"hep-{os.getpid()}-t{next(_counter)}"
    yield p
    if netns.testbed_netns(p) or netns.read_state(p):
        netns.teardown_prefix(p)



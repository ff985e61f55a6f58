"""Test and benchmark helpers (exactness references, builders)."""

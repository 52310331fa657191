"""Vendored public prompt sets used by ``speculum bench`` (see SOURCES.md for attribution)."""

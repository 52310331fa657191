"""Drafters: one file each, behind the protocol in ``base.py``."""

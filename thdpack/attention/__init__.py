"""Exact THD attention."""

"""Acceptance eval with the real target, and a served engine's own acceptance figures."""

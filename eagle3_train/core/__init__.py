"""Formats, the capture contract, storage and the helpers every stage shares."""

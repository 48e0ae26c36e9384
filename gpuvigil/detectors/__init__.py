"""Detectors: one module each, over windowed frames, returning typed findings."""

"""The pipeline: windows collector frames, runs detectors, turns findings into hints."""

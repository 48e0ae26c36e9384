"""Export gpuvigil's state: Prometheus `/metrics` and OpenTelemetry (OTLP), from one snapshot."""

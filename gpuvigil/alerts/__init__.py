"""Alerting: Prometheus rules and Alertmanager config (generated into top-level `alerts/`), and
the pusher that sends gpuvigil's own findings to Alertmanager through a durable outbox."""

"""Grafana dashboards (grafanalib) over gpuvigil's metrics and over plain dcgm-exporter metrics."""

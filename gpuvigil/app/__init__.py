"""Wiring a running process: `serve`, the demo, acting, the sources section."""

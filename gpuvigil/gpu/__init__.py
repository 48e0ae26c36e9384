"""NVIDIA tables: XID meanings and actions, clock-event reasons."""

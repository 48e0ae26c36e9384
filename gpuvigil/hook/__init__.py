"""The in-process hook loaded into training processes: standard library only."""

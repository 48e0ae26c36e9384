"""What reads saved files: the file formats, `analyze`, `replay` and the HTML report."""

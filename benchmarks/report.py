"""Write one benchmark's section of docs/benchmarks.md, leaving the other sections alone."""

from __future__ import annotations

import re
from pathlib import Path

DEFAULT_DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# gpuvigil benchmarks\n\nEach section is written by `gpuvigil bench <kind>`; rerun it to refresh.\n"


def write_section(name: str, markdown: str, doc: Path | None = None) -> Path:
    doc = doc or DEFAULT_DOC
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else HEADER
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{markdown.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _m: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
    return doc

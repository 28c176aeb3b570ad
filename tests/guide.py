"""The README and the user guide (``docs/``) as tests read them: a section by its heading,
whichever page holds it, and every fenced block of a language."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """The README, then every page of the guide."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def section(heading: str) -> str:
    """The text from the heading ``heading`` (at any level: ``## Subscriptions`` finds the
    page titled ``# Subscriptions``) to the end of its page."""
    title = heading.lstrip("#").strip()
    for page in pages():
        text = page.read_text()
        found = re.search(rf"^#+ {re.escape(title)}\s*$", text, re.M)
        if found:
            return text[found.start():]
        if not heading.startswith("#") and heading in text:  # a phrase, not a heading
            return text[text.index(heading):]
    raise AssertionError(f"no section {heading!r} in the README or docs/")


def blocks(language: str) -> list[tuple[Path, str]]:
    """(page, code) of every ``language`` block of every page."""
    return [(page, m.group(1)) for page in pages()
            for m in re.finditer(rf"^```{language}\n(.*?)^```", page.read_text(), re.M | re.S)]

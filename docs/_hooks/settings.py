"""MkDocs hook: the configuration reference, generated from the settings class at build time.

``docs/configuration/index.md`` holds the prose and the marker below; the tables
come from :func:`cdc.settings.doc.render` (the ``#:`` comments of
``cdc/settings/model.py``), so the page can never drift from the code. A settings field
without a description fails the build (strict or not).
"""

from __future__ import annotations

from typing import Any

from cdc.settings.doc import render

MARKER = "<!-- settings-reference -->"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())

"""The landing page at ``/``: a title, a line of description, a version and links
(exporter-toolkit's ``LandingConfig``)."""

from __future__ import annotations

import html
from collections.abc import Sequence

__all__ = ["landing_page"]


def landing_page(
    title: str, description: str, version: str | None, links: Sequence[tuple[str, str]]
) -> bytes:
    """The page as UTF-8 HTML; every text is escaped, links are (href, text)."""
    items = "\n".join(
        # "./metrics" rather than "/metrics": works behind a path-prefix proxy too.
        f'<li><a href="{html.escape("." + href if href.startswith("/") else href)}">'
        f"{html.escape(text)}</a></li>"
        for href, text in links
    )
    title = html.escape(title)
    version_line = f"<p>Version: {html.escape(version)}</p>\n" if version else ""
    return (
        '<!DOCTYPE html>\n<html>\n<head><meta charset="utf-8">'
        f"<title>{title}</title></head>\n<body>\n<h1>{title}</h1>\n"
        f"<p>{html.escape(description)}</p>\n{version_line}<ul>\n{items}\n</ul>\n</body>\n</html>\n"
    ).encode()

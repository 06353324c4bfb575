"""The console's page frame and HTML pieces: escaping, the layout, tables, definition lists.

Guarantees: every value from the pipeline (a key, a payload, an error text, a header) is
escaped (:func:`esc`) - nothing read from Kafka, the engine or the parking lot becomes
markup; every page has one ``<h1>``, landmarks (``header``, ``nav``, ``main``), a skip
link, the current page marked ``aria-current``, a status line as ``role="status"``;
tables have a ``<caption>`` and ``scope``'d headers; values the browser test compares
carry ``data-field`` attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from html import escape

PREFIX = "/console"
#: The overview's refresh period in the browser.
REFRESH_S = 5
#: Characters of a last error shown in a table cell (the detail page shows all of it).
ERROR_CELL_CHARS = 160
#: The pages of the navigation bar: (path, title).
NAV = (
    ("/", "Overview"),
    ("/lag", "Lag"),
    ("/parking", "Parking lot"),
    ("/trace", "Trace"),
    ("/audit", "Audit"),
)


def esc(value: object) -> str:
    """Text of any value, escaped for HTML (None: an en dash)."""
    if value is None:
        return "\u2013"
    return escape(str(value), quote=True)


def when(value: datetime | str | None) -> str:
    if value is None:
        return "\u2013"
    if isinstance(value, str):
        return esc(value)
    text = value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f'<time datetime="{esc(value.isoformat())}">{text}</time>'


def csrf_field(csrf: str) -> str:
    return f'<input type="hidden" name="csrf" value="{esc(csrf)}">'


def page(title: str, body: str, *, path: str, csrf: str | None, status: str = "") -> str:
    """A whole page: head, the navigation (when logged in), the body in ``<main>``."""
    nav = ""
    if csrf is not None:
        items = "".join(
            f'<li><a href="{PREFIX}{p}"'
            + (' aria-current="page"' if p == path else "")
            + f">{esc(t)}</a></li>"
            for p, t in NAV
        )
        nav = (
            f'<nav aria-label="Console pages"><ul>{items}</ul></nav>'
            f'<form method="post" action="{PREFIX}/logout" class="logout">{csrf_field(csrf)}'
            '<button type="submit">Log out</button></form>'
        )
    note = f'<p role="status" class="status">{status}</p>' if status else ""
    meta = f'<meta name="csrf-token" content="{esc(csrf)}">' if csrf else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} \u00b7 outbox-cdc console</title>{meta}"
        f'<link rel="stylesheet" href="{PREFIX}/static/console.css">'
        f'<script src="{PREFIX}/static/console.js" defer></script></head><body>'
        '<a class="skip" href="#main">Skip to content</a>'
        f'<header><p class="brand">outbox-cdc console</p>{nav}</header>'
        f'<main id="main" tabindex="-1"><h1>{esc(title)}</h1>{note}{body}</main>'
        "</body></html>"
    )


def login_page(*, error: str = "", disabled: bool = False) -> str:
    if disabled:
        body = (
            "<p>The console is off: the sink has no admin token. Set <code>ADMIN_API_TOKEN</code>"
            " and restart the sink.</p>"
        )
        return page("Log in", body, path="/login", csrf=None)
    alert = f'<p role="alert" class="error">{esc(error)}</p>' if error else ""
    body = (
        f"{alert}<p>Give the sink's admin token (<code>ADMIN_API_TOKEN</code>).</p>"
        f'<form method="post" action="{PREFIX}/login" class="login">'
        '<label for="token">Admin token</label>'
        '<input id="token" name="token" type="password" autocomplete="current-password" required>'
        '<button type="submit">Log in</button></form>'
    )
    return page("Log in", body, path="/login", csrf=None)


def message_page(title: str, text: str, *, csrf: str | None, path: str) -> str:
    back = f'<p><a href="{PREFIX}{path}">Back</a></p>'
    return page(title, f"<p>{esc(text)}</p>{back}", path=path, csrf=csrf)


# ----------------------------------------------------------------------------- tables
NUM = ' class="num"'


def table(
    caption: str,
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    numeric: Iterable[int] = (),
    empty: str = "none",
    head_cells: Sequence[str] | None = None,
) -> str:
    """A table of already-escaped cells; ``numeric`` columns align right."""
    right = set(numeric)
    ths = head_cells or [
        f'<th scope="col"{NUM if i in right else ""}>{esc(h)}</th>' for i, h in enumerate(headers)
    ]
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="num">{c}</td>' if i in right else f"<td>{c}</td>"
            for i, c in enumerate(row)
        )
        body.append(f"<tr>{cells}</tr>")
    if not body:
        body.append(f'<tr><td colspan="{len(ths)}">{esc(empty)}</td></tr>')
    return (
        f"<table><caption>{esc(caption)}</caption><thead><tr>{''.join(ths)}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def facts(pairs: Iterable[tuple[str, str, str]]) -> str:
    """A definition list of (label, field name for tests or "", escaped value)."""
    items = []
    for label, name, value in pairs:
        attr = f' data-field="{esc(name)}"' if name else ""
        items.append(f"<div><dt>{esc(label)}</dt><dd{attr}>{value}</dd></div>")
    return f'<dl class="facts">{"".join(items)}</dl>'


def section(title: str, body: str, *, ident: str, wide: bool = False) -> str:
    kind = ' class="wide"' if wide else ""
    return (
        f'<section aria-labelledby="{ident}"{kind}><h2 id="{ident}">{esc(title)}</h2>'
        f"{body}</section>"
    )


def unknown(error: str | None) -> str:
    return f'<p class="error">could not be read: {esc(error)}</p>'

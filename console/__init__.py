"""ccsq console: a live operator's view of one swarm in the browser (``ccsq console``).

Server-rendered pages (Starlette + Jinja2, inline CSS and SVG, no script, nothing
fetched from the internet) over the broker's admin commands, with the ledger read
read-only when the broker is down. See docs/console.md.
"""

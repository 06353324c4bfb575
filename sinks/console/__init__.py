"""The operator console: the pipeline on one page, at ``/console/`` on the sink's admin port.

What it is for: :mod:`.app` (the routes, the session and CSRF checks, :func:`.app.with_console`
that puts it in front of the admin app), :mod:`.auth` (sessions and CSRF tokens, pure),
:mod:`.sources` (the reads and actions: the CLI's and the admin API's own functions, on
worker threads, bounded), :mod:`.views` (what each page shows, as data, pure),
:mod:`.history` (recent lag for the sparklines, bounded, pure), :mod:`.pages` (the HTML)
and ``static/`` (one stylesheet, one small script). What it may import: the kernel,
:mod:`sinks.ops`, :mod:`sinks.parking`, :mod:`sinks.trace`, :mod:`sinks.shared`; never the
consumer loop nor the command line. Invariants: nothing but the login form without the
admin token; every action with the session's CSRF token; no logic of its own beyond
presentation - every number is one the CLI or the admin API computes.
"""

"""The sink process's HTTP endpoints: probes, metrics, the parking lot's admin API.

What it is for: :mod:`.app` (:func:`~sinks.http.app.create_app`, the one place the
application is built - extra routes and mounts plug in there), :mod:`.probes`
(``/healthz``, ``/readyz``, ``/metrics``), :mod:`.admin` (list and retry parked
rows), :mod:`.schema` (their bodies, strict) and :mod:`.guard` (the request
guard: the token before any body, bounded headers and bodies; pure decisions).
What it may import: the kernel, :mod:`sinks.core`, :mod:`sinks.parking`; never
the consumer loop, Kafka or the command line (the process in
:mod:`sinks.runtime.service` hands it what it shows). Invariants: the admin token
is checked before any body is read; no answer is a 5xx but 503; no request hangs
on the parking lot.
"""

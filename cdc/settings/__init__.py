"""The relay's and the sink's settings: one typed class, its value checks, its sources, its page.

What it is for: :class:`Settings` (:mod:`.model`: every field, its variable, its ``#:``
documentation) is what every process reads; :mod:`.values` checks a value beyond its
type and redacts secrets; :mod:`.sources` reads the environment and the settings file
(a misspelt name under the project's prefixes refused); :mod:`.doc` renders the
configuration page from the class; :mod:`.checkpoint_names` names a relay's
checkpoint topic. Guarantees: a setting is documented where it is declared (the page
is generated, never written by hand); nothing here imports the relay, the audit or
the sink. ``from cdc.settings import Settings`` is the one import the rest of the
house needs.
"""

from cdc.settings.model import ENV, SECRET_FIELDS, LogFormat, LogLevel, Settings, build, env
from cdc.settings.values import redact_url

__all__ = [
    "ENV",
    "SECRET_FIELDS",
    "LogFormat",
    "LogLevel",
    "Settings",
    "build",
    "env",
    "redact_url",
]

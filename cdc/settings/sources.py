"""Where settings come from - the environment and the TOML file - and which names they may use.

Guarantees:

* :class:`EnvSource` reads each setting from its variable (the field's alias; the proxy
  variables in either case, the upper case first: curl's habit) and librdkafka's settings
  from ``KAFKA_CONFIG_*`` (``KAFKA_CONFIG_SECURITY_PROTOCOL`` becomes
  ``security.protocol``); :class:`TomlSource` reads ``CDC_CONFIG_FILE`` (field names or
  variable names as keys). Both read the names off the settings class they are given:
  nothing here imports :mod:`cdc.settings`;
* a variable under one of :data:`SETTING_PREFIXES` (``CDC_``, ``SINK_``...) that is no
  setting (``SINK_MAX_INFLIGHT``, ``CDC_SLOTT``) is reported by :func:`unknown_variables`
  with the closest setting's name - ``Settings.from_env`` refuses it, as the file's unknown
  keys are refused (:func:`unknown_key`): a misspelt name is never silently ignored;
* not settings, never reported: the names the project reads elsewhere
  (:data:`READ_ELSEWHERE`), librdkafka's ``KAFKA_CONFIG_*``, the rest of ``OUTBOX_*`` (the
  local stack's ``OUTBOX_PG_PORT``, ``OUTBOX_DEV_DIR``; the tests'), ``KAFKA_*`` (Kafka's
  own image reads ``KAFKA_NODE_ID``...), ``LOG_*`` beyond the two settings, and the
  variables Kubernetes and Docker links make for a service named ``sink``, ``engine`` or
  ``cdc`` (``SINK_SERVICE_HOST``, ``ENGINE_PORT=tcp://...``, ``SINK_PORT_9102_TCP_ADDR``).
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from cdc.errors import ConfigError
from cdc.settings.values import KAFKA_CONFIG_PREFIX

CONFIG_FILE_VAR = "CDC_CONFIG_FILE"
#: Proxy variables are read in either case, the upper case first (curl's habit).
_LOWERCASE_FALLBACK = ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY")
#: Every variable whose name starts with one of these is read as a setting of outbox-cdc: one
#: that is none (nor in :data:`READ_ELSEWHERE`) is a misspelling. Not ``OUTBOX_`` itself (the
#: stack's and the tests' variables), only the parking lot's two groups under it.
SETTING_PREFIXES = ("CDC_", "SINK_", "ENGINE_", "ADMIN_API_", "OUTBOX_SCHEDULER_", "OUTBOX_RETRY_")
#: Variables under :data:`SETTING_PREFIXES` read outside the settings class (documented in
#: :data:`cdc.settings.doc.ELSEWHERE`; a unit test holds the two together).
READ_ELSEWHERE = frozenset({CONFIG_FILE_VAR, "CDC_SQL_DIR"})
#: The variables of a Kubernetes service link (a Service ``sink`` gives ``SINK_SERVICE_HOST``,
#: ``SINK_SERVICE_PORT_HTTP``, ``SINK_PORT_9102_TCP_ADDR``) or a Docker link
#: (``SINK_ENV_X``); ``<NAME>_PORT`` only with a ``tcp://`` (udp, sctp) value and
#: ``<NAME>_NAME`` only with a ``/`` one: ``SINK_HTPP_PORT=9102`` is a misspelling.
_SERVICE_LINK = re.compile(
    r"^[A-Z0-9_]+_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?"
    r"|PORT_[0-9]+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?|ENV_[A-Z0-9_]+)$"
)
_LINK_PORT = re.compile(r"^[A-Z0-9_]+_PORT$")
_LINK_URL = re.compile(r"^(tcp|udp|sctp)://")
#: A name this close to a setting's (difflib's ratio) is taken for that setting, misspelt.
_CLOSE = 0.75


def _variables(settings_cls: type[BaseSettings]) -> dict[str, str]:
    """Field name -> its environment variable (every field with an alias)."""
    return {n: f.alias for n, f in settings_cls.model_fields.items() if f.alias is not None}


def unknown_variables(environ: Mapping[str, str], *, known: Collection[str]) -> list[str]:
    """One message per variable of ``environ`` under :data:`SETTING_PREFIXES` that is not
    in ``known`` (the settings' variables): ``unknown setting SINK_MAX_INFLIGHT (did you
    mean SINK_MAX_IN_FLIGHT? every SINK_* variable is read as a setting)``."""
    out = []
    for name in sorted(environ):
        prefix = next((p for p in SETTING_PREFIXES if name.startswith(p)), None)
        if prefix is None or name in known or name in READ_ELSEWHERE:
            continue
        if not _service_link(name, environ[name]):
            out.append(f"unknown setting {name} ({_closest(name, prefix, sorted(known))})")
    return out


def unknown_key(key: str, names: Collection[str]) -> str:
    """An unknown key of the TOML file, with the closest setting when one is close."""
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=_CLOSE)
    return f"unknown setting {key!r}" + (f" (did you mean {close[0]}?)" if close else "")


def _service_link(name: str, value: str) -> bool:
    """``name=value`` is one of the variables a service link defines (not a setting)."""
    if _SERVICE_LINK.match(name):
        return True
    if _LINK_PORT.match(name):
        return _LINK_URL.match(value) is not None
    return name.endswith("_NAME") and value.startswith("/")


def _closest(name: str, prefix: str, names: list[str]) -> str:
    """``did you mean X? ...``: the closest setting - among all when one is close, else the
    closest of ``prefix`` - and why the name was read as a setting at all."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=_CLOSE)
    if not close:
        same = [n for n in names if n.startswith(prefix)] or names
        close = difflib.get_close_matches(name, same, n=1, cutoff=0.0)
    return f"did you mean {close[0]}? every {prefix}* variable is read as a setting"


class EnvSource(PydanticBaseSettingsSource):
    """Settings from an environment mapping: each field's variable, and ``KAFKA_CONFIG_*``."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self._environ = environ
        self._variables = _variables(settings_cls)

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        variable = self._variables.get(field_name, field_name)
        value = self._environ.get(variable)
        if value is None and variable in _LOWERCASE_FALLBACK:
            value = self._environ.get(variable.lower())
        return value, variable, False

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self._variables:
            value, _, _ = self.get_field_value(None, name)
            if value is not None:
                out[name] = value
        kafka_config = {
            key[len(KAFKA_CONFIG_PREFIX) :].lower().replace("_", "."): value
            for key, value in self._environ.items()
            if key.startswith(KAFKA_CONFIG_PREFIX)
        }
        if kafka_config:
            out["kafka_config"] = kafka_config
        return out


class TomlSource(PydanticBaseSettingsSource):
    """Settings from a TOML file: field names or variable names as keys."""

    def __init__(self, settings_cls: type[BaseSettings], path: str | None) -> None:
        super().__init__(settings_cls)
        self._path = path
        self._by_variable = {var: name for name, var in _variables(settings_cls).items()}

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        if not self._path:
            return {}
        try:
            raw = tomllib.loads(Path(self._path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{CONFIG_FILE_VAR} {self._path}: {exc}") from exc
        return {self._by_variable.get(key, key): value for key, value in raw.items()}

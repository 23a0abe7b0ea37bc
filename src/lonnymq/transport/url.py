"""Broker URLs: ``lonnymq://USER:PASSWORD@HOST:PORT/DBNAME?libpq-parameters``.

The URL is a libpq connection URI under another scheme, so everything libpq accepts works:
several hosts (``lonnymq://u:p@db1:5432,db2:5432/app?target_session_attrs=read-write``),
``sslmode``, ``sslrootcert``, ``connect_timeout``, ``application_name``... A kombu
connection given as separate fields (hostname, userid, password, port, virtual_host as the
database name) works too.

kombu's ``Connection`` has fields for a host, port, user, password, database and connect
timeout, and fills them itself for transports whose URL it parses. It cannot parse ours (a
libpq parameter in the query is a ``TypeError`` to it, several ``HOST:PORT`` pairs a
``ValueError``), so lonnymq fills them (:func:`fill_fields`) when the Connection is made
(``import lonnymq`` wraps kombu's ``Connection.__init__`` for it), and the transport again
when kombu creates it (:func:`adopt_url`). What the fields cannot hold (``sslmode`` and the
other libpq parameters, a port per host) goes to the transport option ``connection_params``
(:data:`PARAMS_OPTION`), which ``Connection.clone()`` and pickling keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..dsn import SCHEMES, mask_password, meant, scheme_problem
from ..exceptions import ConfigurationError


def to_conninfo(url: str) -> str:
    """The libpq connection string for a broker URL; raises ConfigurationError if invalid."""
    if not isinstance(url, str) or not url:
        raise ConfigurationError("the broker URL must be a non-empty string")
    problem = scheme_problem(url)
    if problem:
        raise ConfigurationError(problem)
    if "://" in url:
        url = "postgresql://" + url.split("://", 1)[1]
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(
            f"invalid broker URL {mask_password(url)!r}: {mask_password(str(exc))}"
        ) from None
    for port in str(params.get("port") or "").split(","):
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigurationError(f"invalid port {port!r} in broker URL {mask_password(url)!r}")
    check_params(params, f"broker URL {mask_password(url)!r}")
    return url


#: libpq parameters whose value is one of a few words: a typo is a configuration error (which
#: kombu and Celery do not retry), not a connection failure to retry forever.
_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
    "load_balance_hosts": ("disable", "random"),
    "sslnegotiation": ("postgres", "direct"),
}
_INTEGERS = ("connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval")


def check_params(params: dict[str, Any], where: str) -> None:
    """Refuse a libpq parameter whose value libpq would refuse only when connecting; ``where``
    says where it was given (``broker URL '...'``)."""
    for key, choices in _CHOICES.items():
        value = params.get(key)
        if value is not None and str(value) not in choices:
            raise ConfigurationError(
                f"invalid {key} {str(value)!r} in {where}: expected one of {', '.join(choices)}"
            )
    for key in _INTEGERS:
        value = params.get(key)
        if value is not None and not str(value).strip().lstrip("-").isdigit():
            raise ConfigurationError(
                f"invalid {key} {str(value)!r} in {where}: expected an integer"
            )


def check_connection_params(params: object) -> None:
    """The transport option ``connection_params``: libpq parameters by name."""
    where = f"transport option {PARAMS_OPTION}"
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise ConfigurationError(
            f"{where} must be a dict of libpq parameters, such as {{'sslmode': 'require'}}"
        )
    known = {str(d.keyword.decode()) for d in psycopg.pq.Conninfo.get_defaults()}
    for key, value in params.items():
        if key not in known:
            raise ConfigurationError(
                f"{where}: {key!r} is not a libpq parameter{meant(key, known)}"
            )
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ConfigurationError(f"{where}: {key} must be text or an integer, not {value!r}")
    check_params(params, where)


def from_fields(
    hostname: str | None,
    port: int | None,
    userid: str | None,
    password: str | None,
    database: str | None,
    extra: dict[str, Any] | None = None,
) -> str:
    """A libpq connection string from kombu's separate connection fields; ``extra`` (libpq
    parameters, such as the transport option ``connection_params``) adds to them, and wins
    over them (a host list with a port per host)."""
    params: dict[str, Any] = {
        "host": hostname or None,
        "port": port or None,
        "user": userid or None,
        "password": password or None,
        "dbname": database or None,
    }
    params.update(extra or {})
    try:
        return make_conninfo("", **{k: v for k, v in params.items() if v is not None})
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"invalid connection parameters: {exc}") from None


def as_uri(
    url: str, include_password: bool = False, mask: str = "**", *, password: str | None = None
) -> str:
    """The URL to show (in logs, ``kombu.Connection.as_uri()``): password masked unless asked.
    ``password``: the one kombu's Connection holds in its field, for a URL without one."""
    if "://" not in url:
        return url if include_password else mask_password(url, mask)
    scheme, rest = url.split("://", 1)
    shown = f"lonnymq://{rest}" if scheme.lower() in SCHEMES else url
    if password and not _has_password(url):
        secret = quote(password, safe="") if include_password else quote(mask, safe="*")
        scheme, rest = shown.split("://", 1)
        end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0] or [len(rest)])
        netloc, tail = rest[:end], rest[end:]
        if "@" in netloc:
            user, hosts = netloc.rsplit("@", 1)
            netloc = f"{user}:{secret}@{hosts}"
        else:
            netloc = f":{secret}@{netloc}"
        return f"{scheme}://{netloc}{tail}"
    return shown if include_password else mask_password(shown, quote(mask, safe="*"))


def _has_password(url: str) -> bool:
    try:
        return "password" in conninfo_to_dict(to_conninfo(url))
    except ConfigurationError:
        return True  # shown masked as it is


#: The keywords kombu's Connection takes from a URL it parses (``Connection._init_params``): it
#: parses every URL it fails over to, alternates and the first URL alike.
_KOMBU_URL_KEYS = frozenset(
    {
        "transport",
        "hostname",
        "port",
        "userid",
        "password",
        "virtual_host",
        "insist",
        "ssl",
        "connect_timeout",
        "login_method",
        "heartbeat",
        "credential_provider",
    }
)


#: The transport option holding the libpq parameters of a broker URL that kombu's Connection
#: has no field for: ``{"sslmode": "require", "application_name": "app"}``; a host list's
#: ``host`` and ``port`` when the fields cannot say them (a port per host, no host at all:
#: libpq's default socket). Filled from the URL when the Connection is made; it can be given
#: by hand with a Connection made of separate fields. The URL's parameters win over it.
PARAMS_OPTION = "connection_params"


@dataclass(frozen=True)
class Fields:
    """kombu ``Connection`` fields for a broker URL."""

    #: The host, or hosts (comma-separated, as libpq takes them).
    hostname: str
    #: The port (of the first host, when each has its own).
    port: int | None
    userid: str | None
    password: str | None
    virtual_host: str | None
    connect_timeout: float | None
    #: What the fields cannot hold: see :data:`PARAMS_OPTION`.
    params: dict[str, str]


def split(url: str) -> Fields:
    """kombu's Connection fields for a broker URL (raises ConfigurationError if invalid)."""
    params = {k: str(v) for k, v in conninfo_to_dict(to_conninfo(url)).items()}
    host = params.pop("host", "")
    ports = params.pop("port", "")
    user = params.pop("user", None)
    password = params.pop("password", None)
    dbname = params.pop("dbname", None)
    timeout = params.pop("connect_timeout", None)
    port_list = ports.split(",") if ports.strip(",") else []
    one_port = len(set(port_list)) <= 1 and "" not in port_list
    if not host or not one_port:
        # a port per host, or libpq's default host (its socket): the fields cannot say it
        params["host"] = host
        if ports:
            params["port"] = ports
    return Fields(
        hostname=host or "localhost",
        port=int(port_list[0]) if port_list and port_list[0] else None,
        userid=user or None,
        password=password,
        virtual_host=dbname or None,
        connect_timeout=float(timeout) if timeout is not None else None,
        params=params,
    )


def connection_params(client: Any) -> dict[str, Any]:
    """The libpq parameters a kombu Connection holds besides its fields (see
    :data:`PARAMS_OPTION`)."""
    options = getattr(client, "transport_options", None) or {}
    params = options.get(PARAMS_OPTION) if isinstance(options, dict) else None
    return dict(params) if isinstance(params, dict) else {}


def with_password(conninfo: str, password: str | None) -> str:
    """``conninfo`` with ``password`` added, unless it has one of its own (or none is given)."""
    if not password or "password" in conninfo_to_dict(conninfo):
        return conninfo
    return make_conninfo(conninfo, password=password)


def check_alternates(urls: list[Any]) -> None:
    """Refuse, with what to do instead, failover URLs that kombu's failover cannot take.

    kombu parses each URL it fails over to with its own parser (``Connection.switch``), which
    takes no libpq parameter but ``connect_timeout`` and no ``HOST:PORT`` list: it would raise a
    ``TypeError`` or ``ValueError`` at the first failover, not at start. A URL without a host
    (libpq's socket) cannot be said in kombu's fields either: the first URL's would stay in
    ``connection_params`` after kombu fails over, and send the alternate to the socket."""
    from kombu.utils.url import parse_url

    if len(urls) < 2:
        return
    for url in urls:
        if not isinstance(url, str) or "://" not in url:
            continue
        try:
            parsed = parse_url(url)
        except ValueError:
            parsed = {"a port per host": True}
        if "hostname" in parsed and not parsed["hostname"]:
            raise ConfigurationError(
                f"no host in {mask_password(url)!r}: with several URLs separated by ';', give "
                "each its host (libpq's socket directory as one: lonnymq://USER@"
                "%2Fvar%2Frun%2Fpostgresql/DB)"
            )
        unknown = sorted(set(parsed) - _KOMBU_URL_KEYS)
        if unknown:
            raise ConfigurationError(
                f"{', '.join(unknown)} in {mask_password(url)!r}: with several URLs separated "
                "by ';', kombu parses each one itself when it fails over, and takes no libpq "
                "parameter but connect_timeout. Give one URL with several hosts instead "
                "(lonnymq://USER@HOST1:PORT,HOST2:PORT/DB?sslmode=...&target_session_attrs="
                "read-write: libpq tries them in turn), or set the parameter in the environment "
                "(PGSSLMODE, PGAPPNAME...)"
            )


def for_client(client: Any, uri: str, include_password: bool, mask: str) -> str:
    """The URL a transport shows for its kombu Connection ``client`` (``as_uri``): ``uri``
    with its password masked unless asked, or, without a URL, from the Connection's fields
    (NotImplementedError without a Connection: kombu then shows the hostname)."""
    password = getattr(client, "password", None)
    if uri and "://" in uri:
        if callable(password):
            password = None
        return as_uri(uri, include_password, mask, password=password)
    if client is None:
        raise NotImplementedError
    return from_client(client, include_password, mask)


def from_client(client: Any, include_password: bool, mask: str) -> str:
    """The URL to show for a kombu Connection whose fields hold the host (no URL), with the
    libpq parameters of its transport option ``connection_params`` in the query."""
    params = connection_params(client)
    user = quote(str(client.userid), safe="") if client.userid else ""
    if client.password and not callable(client.password):
        user += ":" + (quote(str(client.password), safe="") if include_password else mask)
    hosts = str(params.pop("host") if "host" in params else client.hostname or "localhost")
    ports = str(params.pop("port") if "port" in params else client.port or "").split(",")
    host_list = hosts.split(",") if hosts else []
    if len(ports) == 1:
        ports = ports * max(1, len(host_list))  # libpq: one port for every host
    netloc = ",".join(
        quote(h, safe="") + (f":{p}" if p else "") for h, p in zip(host_list, ports, strict=False)
    )
    netloc = (user + "@" if user else "") + netloc
    vhost = client.virtual_host
    path = "/" + quote(str(vhost), safe="") if vhost not in (None, "", "/") else ""
    if not include_password and "sslpassword" in params:
        params["sslpassword"] = mask
    query = "?" + urlencode({k: str(v) for k, v in params.items()}, safe="*,") if params else ""
    return f"lonnymq://{netloc}{path}{query}"


def adopt_url(client: Any) -> None:
    """Fill the kombu Connection's fields from its URL (kombu leaves the whole URL in
    ``hostname``, since the transport parses its own URLs): ``hostname``, ``port``, ``userid``,
    ``password``, ``virtual_host`` (the database) and ``connect_timeout``, as kombu does for
    amqp and redis, so ``Connection.info()`` (Celery's ``inspect stats``, Flower) shows them, and
    never the password. The URL's libpq parameters go to the transport option
    ``connection_params`` (a new dict: the caller's ``transport_options`` are not changed)."""
    hostname = client.hostname
    if not isinstance(hostname, str) or "://" not in hostname:
        return
    fields = split(hostname)
    client.hostname = fields.hostname
    client.port = fields.port or client.port
    client.userid = fields.userid or client.userid
    client.password = fields.password or client.password
    if fields.virtual_host:
        client.virtual_host = fields.virtual_host
    if fields.connect_timeout is not None:
        client.connect_timeout = fields.connect_timeout
    if fields.params:
        options = dict(getattr(client, "transport_options", None) or {})
        options[PARAMS_OPTION] = {**connection_params(client), **fields.params}
        client.transport_options = options


def fill_fields(client: Any) -> None:
    """:func:`adopt_url` when a kombu Connection is made (see ``lonnymq._fill_fields_when_made``):
    a URL that does not parse is left whole, for the transport to refuse on first use with
    its reason (kombu makes Connections where no error is expected, Celery's app setup)."""
    try:
        adopt_url(client)
    except (ConfigurationError, ValueError):
        return


def client_connect_timeout(client: Any) -> float | None:
    """kombu's ``connect_timeout``, a number even when kombu took it, as text, from a URL it
    parsed (an alternate it failed over to): then it is made a number for kombu too."""
    value = getattr(client, "connect_timeout", None)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigurationError(
                f"invalid connect_timeout {value!r} in the broker URL: expected seconds"
            ) from None
        client.connect_timeout = value
    return value


def client_conninfo(client: Any) -> str:
    """The libpq connection string of a kombu Connection: from its URL, or from its fields
    (host, port, user, password, and the virtual host as the database) and its transport
    option ``connection_params``."""
    hostname = client.hostname or "localhost"
    password = client.password() if callable(client.password) else client.password
    if "://" in hostname:
        return with_password(to_conninfo(hostname), password)
    vhost = client.virtual_host
    return from_fields(
        hostname,
        client.port,
        client.userid,
        password,
        None if vhost in (None, "", "/") else vhost,
        connection_params(client),
    )

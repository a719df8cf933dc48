"""How a qflow tool secures its connections: the TLS and SASL options,
their usage errors, and the TLS context and connection options they give.
"""

from __future__ import annotations

import argparse
import ssl
from typing import Any

from ._addresses import BrokerUrl
from ._errors import ToolError


def add_tls_options(p: argparse.ArgumentParser, management: bool = False) -> None:
    """The TLS and SASL options, with the qpid tools' names (their aliases in
    qflowd's spelling): the CA that signs the broker's certificate, this
    client's own certificate and key (mutual TLS), and the mechanism."""
    where = "the broker's TLS port (amqps://) and https management API" if management else \
        "the broker's TLS port (amqps://)"
    p.add_argument("--ssl-trustfile", "--ssl-ca-file", dest="ssl_trustfile", metavar="FILE",
                   help=f"CA certificates (PEM) that sign {where}'s certificate (default: the system's); its "
                        "host name is checked against the one in -b")
    p.add_argument("--ssl-certificate", "--ssl-cert-file", dest="ssl_certificate", metavar="FILE",
                   help="this client's certificate (PEM), for a broker that asks for one (mutual TLS); without a "
                        "user in -b, it authenticates as the certificate's name (EXTERNAL)")
    p.add_argument("--ssl-key", "--ssl-key-file", dest="ssl_key", metavar="FILE",
                   help="the private key (PEM) of --ssl-certificate, if not in that file")
    p.add_argument("--sasl-mechanism", choices=("SCRAM-SHA-256", "PLAIN", "EXTERNAL", "ANONYMOUS"), default=None,
                   metavar="MECH", help="SCRAM-SHA-256 (the default with a user), PLAIN, EXTERNAL (the default with "
                                        "--ssl-certificate and no user) or ANONYMOUS")


def check_tls_options(parser: argparse.ArgumentParser, args: argparse.Namespace, url: BrokerUrl,
                      management: bool = False) -> None:
    """Usage errors (exit 2) of the TLS options, before anything is sent."""
    if args.ssl_key and not args.ssl_certificate:
        parser.error("--ssl-key needs --ssl-certificate")
    given = next((name for name, value in (("--ssl-trustfile", args.ssl_trustfile),
                                           ("--ssl-certificate", args.ssl_certificate)) if value), None)
    if given and not url.tls and not management:
        parser.error(f"{given} is for TLS: give the broker's TLS address, amqps://HOST:PORT")
    mechanism = args.sasl_mechanism
    if mechanism == "EXTERNAL" and (url.username is not None or not args.ssl_certificate or
                                    not (url.tls or management)):
        parser.error("--sasl-mechanism EXTERNAL takes no user in -b, and needs --ssl-certificate and a TLS "
                     "address (amqps://)")
    if mechanism in ("SCRAM-SHA-256", "PLAIN") and url.username is None:
        parser.error(f"--sasl-mechanism {mechanism} needs a user: -b USER/PASSWORD@HOST:PORT")
    if mechanism == "ANONYMOUS" and url.username is not None:
        parser.error("--sasl-mechanism ANONYMOUS takes no user in -b")


def client_tls(args: argparse.Namespace) -> ssl.SSLContext:
    """The TLS context of the tool's options (qflow.client.tls_context).
    Raises ToolError naming the option whose file cannot be used."""
    from qflow.client.connection import tls_context

    try:
        context = tls_context(ca_file=args.ssl_trustfile)
    except (OSError, ssl.SSLError) as exc:
        raise ToolError(f"cannot load --ssl-trustfile {args.ssl_trustfile}: "
                        f"{getattr(exc, 'strerror', None) or exc}") from None
    if args.ssl_certificate:
        try:
            context.load_cert_chain(args.ssl_certificate, args.ssl_key)
        except (OSError, ssl.SSLError) as exc:
            what = f"--ssl-certificate {args.ssl_certificate}" + (f" / --ssl-key {args.ssl_key}"
                                                                  if args.ssl_key else "")
            raise ToolError(f"cannot load {what}: {getattr(exc, 'strerror', None) or exc}") from None
    return context


def connect_options(args: argparse.Namespace, url: BrokerUrl) -> dict[str, Any]:
    """qflow.connect's keyword arguments for ``url`` and the tool's TLS and
    SASL options: credentials, mechanism, ssl_context. Raises ToolError."""
    options = dict(url.credentials)
    mechanism = args.sasl_mechanism
    if mechanism is None and url.username is None and args.ssl_certificate and url.tls:
        mechanism = "EXTERNAL"  # as qpid's clients do with a certificate and no user
    if mechanism is not None:
        options["mechanism"] = mechanism
    if url.tls:
        options["ssl_context"] = client_tls(args)
    return options


def tls_failure(what: str, exc: OSError) -> ToolError:
    from qflow.transport.tls import client_handshake_failure

    return ToolError(f"TLS with {what} failed: {client_handshake_failure(exc)}")

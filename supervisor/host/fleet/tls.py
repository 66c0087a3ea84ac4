"""Mutual TLS between the gateways of a fleet, where `[listen] tls_cert` is set.

Each gateway's certificate (`[listen] tls_cert` and `tls_key`) serves its listener and is the
client certificate it presents to its peers; `[fleet] ca_file` is the CA that signed every
gateway's certificate. The listener asks every client for a certificate and verifies one that
comes against that CA, but goes on without one: a caller's client on /v1 has none. The peer
route requires one (door.py: 401 without). A gateway dialling a peer verifies the peer's
certificate against the same CA, for the host of the peer's `advertise` URL (its certificate
names that host or address), and presents its own. The certificates are used for both ends:
with an extended key usage, it names serverAuth and clientAuth.
"""

from __future__ import annotations

import ssl
from pathlib import Path


def ask_for_peers(context: ssl.SSLContext, ca_file: Path) -> None:
    """The listener's context asks for a client certificate signed by the fleet's CA, and
    verifies one that comes; ssl.SSLError or OSError when the CA file cannot be used."""
    context.load_verify_locations(cafile=ca_file)
    context.verify_mode = ssl.CERT_OPTIONAL


def client_context(cert: Path, key: Path, ca_file: Path) -> ssl.SSLContext:
    """The context a gateway dials its peers with: its own certificate presented, theirs
    verified against the fleet's CA; ssl.SSLError or OSError when a file cannot be used."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context

"""Several machines as one service: the catalog, the choice of a peer, peer keys, forwarding.

- rows.py: what one machine publishes of each engine (`PeerEngine`), and its stored form
- tables.py, catalog.py: the catalog shared in PostgreSQL: publish, heartbeat, LISTEN/NOTIFY
- choose.py: which peer machine's engine a request for a model goes to
- peers.py, tls.py: the peer keys, mutual TLS; door.py: the peer route; forward.py: to a peer
"""

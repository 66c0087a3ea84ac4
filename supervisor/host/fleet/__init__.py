"""Several machines as one service: peer keys, the peer route, forwarding to a peer."""

"""The gateway: the host's HTTP server, assembling the /v1 proxy, the host API and the page."""

"""The /v1 proxy and the owner's host API: engines found, started, admitted and forwarded to."""

"""The host's commands in one place: the engines', the gateway's, the keys', usage and models."""

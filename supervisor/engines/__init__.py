"""Engines: the base and container engine, the registry, recipe loading, one folder per kind."""

"""Engines: the base and container engine, the registry, and one folder per kind of engine."""

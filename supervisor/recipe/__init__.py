"""Recipes: the common sections and secrets every kind's schema builds on (no engine)."""

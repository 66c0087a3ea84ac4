"""Recipes: the common sections, secrets, and finding and loading a recipe file."""

"""The labels lucia-supervisor puts on what it creates in Docker: every key in one place."""

from __future__ import annotations

from typing import Final

PREFIX: Final = "lucia."
MANAGED: Final = "lucia.managed"  # "true" on every container and network lucia creates
NAME: Final = "lucia.name"  # the worker's name (the data directory's engine name)
DATA: Final = "lucia.data"  # the worker's data directory: which user's installation made it
ENGINE: Final = "lucia.engine"  # the engine kind: tensorfold, llama-router
GENERATION: Final = "lucia.generation"  # the request the container was started for
IMAGE_ID: Final = "lucia.image.id"  # the image id it was created from
IMAGE_REF: Final = "lucia.image.ref"  # the image reference that id was resolved from
FINGERPRINT: Final = "lucia.fingerprint"  # digests of everything it was created with
MODEL: Final = "lucia.model"  # the model it serves
MODEL_REVISION: Final = "lucia.model.revision"  # the model's revision or file digest, if known
RECIPE_COMMIT: Final = "lucia.recipe.commit"  # the recipe commit (containers and recipe images)
RECIPE_REPOSITORY: Final = "lucia.recipe.repository"  # on recipe images
GRAMMAR_BASE: Final = "lucia.grammar.base"  # on grammar images: the base image id
GRAMMAR_REQUIREMENT: Final = "lucia.grammar.requirement"  # on grammar images: the pip pin
GRAMMAR_MODULES: Final = "lucia.grammar.modules"  # on grammar images: the modules checked
TIERS_BASE: Final = "lucia.tiers.base"  # on KV tier images: the base image id
TIERS_VERSION: Final = "lucia.tiers.version"  # on KV tier images: the plugin's version
TIERS_DIGEST: Final = "lucia.tiers.digest"  # on KV tier images: a digest of the plugin's files

# Bookkeeping that changes without changing what runs: never part of the fingerprint (a
# container made before DATA existed is adopted as it is, never replaced for the label).
BOOKKEEPING: Final = frozenset({GENERATION, FINGERPRINT, DATA})

"""The record: one row per generation, no text, and each key's spending per UTC day."""

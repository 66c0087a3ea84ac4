"""The gateway: an authenticated OpenAI-compatible /v1 in front of the engines."""

"""The host's model library, GGUF headers and checks, the fast copy and the local model cache."""

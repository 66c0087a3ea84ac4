"""The model library's on-disk format and its GGUF files' checks and headers, for both sides."""

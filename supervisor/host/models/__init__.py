"""The model library's downloads: the manifest, the hub, the hf child, the checks, the queue."""

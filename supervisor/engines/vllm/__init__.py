"""The vLLM engine: its engine, GPU preflight and KV-cache tiers."""

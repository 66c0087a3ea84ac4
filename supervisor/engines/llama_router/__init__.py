"""The llama.cpp router engine: the engine, its GGUF cache, library sync, API, plan and preset."""

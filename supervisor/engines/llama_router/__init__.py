"""The llama.cpp router engine: its engine, library sync, router API, memory and preset."""

"""The engine APIs: LLM (offline), AsyncEngine (the server's), the EngineClient protocol the server sees them
through, and the factory that builds an engine's parts from an EngineConfig."""

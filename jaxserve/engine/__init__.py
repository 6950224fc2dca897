"""The engine APIs: LLM (offline), AsyncEngine (the server's), and the factory that builds an engine from an EngineConfig."""

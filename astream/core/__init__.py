"""astream.core: EngineCore (no event loop), its requests and sequences, and the scheduler."""

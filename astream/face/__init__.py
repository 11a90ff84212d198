"""astream.face: what users touch: the command line and its settings, the client, the LLM facade."""

"""astream.engine: the async layer: the Engine on an event loop, request streams, load progress."""

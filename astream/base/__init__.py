"""astream.base: plain types and pure functions: config, sampling, outputs, errors, checks, metrics."""

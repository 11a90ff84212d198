"""astream.text: prompts to token ids, incremental detokenization and stop strings."""

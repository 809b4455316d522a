"""Text in and out of the engine: tokenizer files and chat templates, incremental detokenisation,
stop strings and finish reasons."""

"""Prompt text: the project's token counter, ShareGPT reading, and prompt block hashes
(the keys of an engine's prefix cache)."""

"""User-facing entry points: the offline LLM, the CLI and the OpenAI server."""

"""What runs in the API process or beside ``LLM``: requests in, text out; the core client."""

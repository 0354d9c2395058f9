"""The OpenAI-compatible server: ``build_app`` for embedding, ``run_server`` for ``tokenmill serve``."""

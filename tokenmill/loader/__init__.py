"""Hugging Face model directories → ModelConfig and parameters."""

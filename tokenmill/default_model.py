"""Where the embedded default model lives: a Hugging Face directory inside the package."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "data" / "default_model"

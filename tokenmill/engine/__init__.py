"""The engine: scheduler, KV cache manager, model runner, and the step that ties them."""

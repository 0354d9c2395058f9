"""Model architectures: pure nn.Modules over ``layers/``, knowing nothing of requests."""

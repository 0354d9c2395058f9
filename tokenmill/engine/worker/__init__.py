"""What runs the model: flat batch, forward, sampling; graphs, host staging, tensor-parallel ranks."""

"""Building blocks of the models: attention, rotary, norms, linear, sampler."""

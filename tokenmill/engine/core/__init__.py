"""The engine core: schedule, run, update; it sees only valid, tokenized requests."""

"""The training loop and its parts (optimizer, schedule)."""

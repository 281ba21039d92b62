"""mexc: compile a float PyTorch model into an integer-only training program."""

__version__ = "0.1.0"

"""Compiler passes: each a pure function Graph -> Graph in a module named after the pass."""

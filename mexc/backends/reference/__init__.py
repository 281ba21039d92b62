"""target="reference": the numpy interpreter, the executable form of docs/numerics.md."""

"""Side-by-side benchmarks of the engine's modes (used by `minedraft bench`)."""

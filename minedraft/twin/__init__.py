"""A twin of the engine driven by GPU cost curves: the engine's own policy code on simulated time."""

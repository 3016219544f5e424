"""mpt's shared training engine: one loop for every paper model and precision mode."""

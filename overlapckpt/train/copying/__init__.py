"""The copy path: the state laid out and planned in groups, host slots, and the copier over the device seam (CUDA or emulated)."""

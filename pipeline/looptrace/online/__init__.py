"""Online early exit: the engine that really stops looping, and the latency measurement built on it."""

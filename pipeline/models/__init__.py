"""Models: looptrace's own looped transformer, depth-supervision regimes, training, the model interface
the capture uses, and adapters for real checkpoints."""

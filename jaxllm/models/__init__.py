"""Model definitions (Flax NNX) and weight loading."""

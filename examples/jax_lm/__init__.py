"""A byte-level causal LM in Flax NNX with Tensor Memory: jitted prefill, scanned decode."""

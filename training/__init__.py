"""jaxdecode.training: Flax NNX + optax + orbax training of LMs, drafters, heads and filters."""

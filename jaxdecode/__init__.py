"""jaxdecode: pure-functional, jit-compiled decoders for language models in JAX."""
__version__ = "0.1.0"

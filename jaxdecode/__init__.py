"""jaxdecode: pure-functional, jit-compiled decoders for language models in JAX.

    model = jaxdecode.load(path)                       # HF checkpoint dir (or None: embedded model)
    out = jaxdecode.generate(model, ["def f("], method="greedy", max_new_tokens=32)
"""
from jaxdecode.api import Generation, Model, generate, load, methods, register_method
from jaxdecode.drafters.trained import load_drafter

__version__ = "0.1.0"
__all__ = ["Generation", "Model", "generate", "load", "load_drafter", "methods", "register_method"]

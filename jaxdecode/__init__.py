"""jaxdecode: pure-functional, jit-compiled decoders for language models in JAX.

    model = jaxdecode.load(path)                       # HF checkpoint dir (or None: embedded model)
    out = jaxdecode.generate(model, ["def f("], method="greedy", max_new_tokens=32)
    for piece in jaxdecode.stream(model, "def f(", max_new_tokens=32): print(piece, end="")
"""
from jaxdecode.api import Generation, Model, apply_chat_template, generate, load, methods, register_method
from jaxdecode.drafters.trained import load_drafter
from jaxdecode.genconfig import GenerationConfig
from jaxdecode.scoring import Score, score
from jaxdecode.streaming import Stream, stream, stream_to

__version__ = "0.1.0"
__all__ = ["Generation", "GenerationConfig", "Model", "Score", "Stream", "apply_chat_template", "generate", "load",
           "load_drafter", "methods", "register_method", "score", "stream", "stream_to"]

"""jaxdecode.kernels: Pallas kernels, each beside its pure-jnp reference."""
from .tree_attention import (
    sharded_tree_attention,
    tree_attention,
    tree_attention_pallas,
    tree_attention_reference,
)

__all__ = [
    "sharded_tree_attention",
    "tree_attention",
    "tree_attention_pallas",
    "tree_attention_reference",
]

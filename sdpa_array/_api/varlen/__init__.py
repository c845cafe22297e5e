"""The packed variable-length layout: :func:`scaled_dot_product_attention_varlen` and its
VJP, on ``(total, heads, features)`` arrays split by cumulative sequence offsets."""

from .forward import scaled_dot_product_attention_varlen
from .vjp import scaled_dot_product_attention_varlen_vjp

__all__ = ["scaled_dot_product_attention_varlen", "scaled_dot_product_attention_varlen_vjp"]

"""Lowering: one pure JAX function per Caffe layer type, registered by name, composed into one program."""

from caffejax.lower.registry import LayerContext, LayerRule, get_rule, register, registered_types

__all__ = ["LayerContext", "LayerRule", "get_rule", "register", "registered_types"]

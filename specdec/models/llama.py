"""The target model's older import path: ``LlamaModel`` is :class:`~specdec.models.transformer.TransformerModel`,
the one model definition of every supported family (Llama among them; specdec/models/families.py)."""

from .transformer import ForwardOut, TransformerModel, load_target

LlamaModel = TransformerModel

__all__ = ["ForwardOut", "LlamaModel", "TransformerModel", "load_target"]

"""Structured outputs: generation constrained by a JSON schema, a regex, a choice or a grammar."""
from moe.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]

"""GGUF -> Hugging Face folder conversion (`cadence convert`)."""

from cadence.convert.folder import DTYPES, convert_gguf, is_converted

__all__ = ["DTYPES", "convert_gguf", "is_converted"]

"""GGUF -> Hugging Face folder: the folder cadence serves a GGUF from, or a float copy
(`cadence convert`)."""

from cadence.convert.folder import DTYPES, convert_gguf, gguf_folder, is_converted

__all__ = ["DTYPES", "convert_gguf", "gguf_folder", "is_converted"]

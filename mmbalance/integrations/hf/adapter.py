"""Old name of :mod:`.encoder_adapter` (the adapter interface and its registry)."""

from .encoder_adapter import EncoderAdapter, Items, flops_linear, packed_rows  # noqa: F401

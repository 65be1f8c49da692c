"""Hugging Face models: ``mmbalance bench hf`` (``python -m mmbalance.bench.hf``).

Read ``train_step.py`` (``--device``: one training step on one device, ``mmbalance_varlen`` against
``sdpa`` and ``flash_attention_2``) and ``encoders.py`` (encoder balancing's overhead against the
encoder on several ranks, and the command).
"""

from .encoders import main

__all__ = ["main"]

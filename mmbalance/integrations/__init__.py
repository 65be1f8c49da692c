"""Glue to the trainers users already run (``mmbalance.integrations``).

* :mod:`mmbalance.integrations.hf`: Hugging Face transformers models: encoder balancing
  (``apply_encoder_balance``), a packed varlen attention backend (``register_attention``), and
  balanced batches in ``Trainer`` (``balance_trainer``). Needs the ``hf`` extra (``pip install "mmbalance[hf]"``).
* :mod:`mmbalance.integrations.data`: ``BalancedBatchSampler``, balanced per-rank batches with no
  communication (gradient accumulation and padded micro-batches included), for any trainer's data
  loader.

Third-party imports are lazy: importing this package needs neither transformers nor torch.
"""

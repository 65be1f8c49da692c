"""Glue to the trainers users already run (``mmbalance.integrations``).

* :mod:`mmbalance.integrations.hf`: Hugging Face transformers models: encoder balancing
  (``apply_encoder_balance``) and a packed varlen attention backend (``register_attention``).
  Needs the ``hf`` extra (``pip install "mmbalance[hf]"``).
* :mod:`mmbalance.integrations.data`: ``BalancedBatchSampler``, balanced per-rank batches with no
  communication, for any trainer's data loader.

Third-party imports are lazy: importing this package needs neither transformers nor torch.
"""

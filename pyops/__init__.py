"""``torch.library`` custom ops, namespace ``torch.ops.mmbalance`` (``mmbalance.pyops``).

Importing this package registers every op.
"""

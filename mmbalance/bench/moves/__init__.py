"""Moving tokens: the varlen copies, the all-to-all exchange and the all-gather/GEMM overlap.

``varlen.py`` (``mmbalance bench varlen``: the bandwidth of pack, unpack and segment_gather against
torch baselines and a device copy), ``alltoall.py`` (``mmbalance bench alltoall``: ``rebalance`` on
real-data mixtures, its time and volumes per plan) and ``overlap.py`` (``mmbalance bench
overlap``: the sliced all-gather/GEMM against its GEMM and its collective alone); each is a command
of its own (``python -m mmbalance.bench.moves.<name>``).
"""

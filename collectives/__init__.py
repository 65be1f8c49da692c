"""Everything that talks between ranks (``mmbalance.collectives``)."""

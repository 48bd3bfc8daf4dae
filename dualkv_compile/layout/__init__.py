"""The packed layout: one micro-batch's prompts once and responses after them (packing.py),
the checks of the batch it is packed from (batch_checks.py), its padded lengths (buckets.py),
the tables a compiled graph reads it through (inputs.py), and micro-batches planned by a
packed-token budget (plan.py)."""

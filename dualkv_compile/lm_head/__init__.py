"""The LM head over the rows that need logprobs: chunked log-softmax and fused token losses
(logprobs.py, with a Triton statistics kernel in chunk_stats_kernel.py) and the gather of the
packed rows it reads (gather_rows.py), which rows those are and where the results go
(targets.py)."""

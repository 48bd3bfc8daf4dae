"""FX graph passes run by the dualkv compile backend (installed as dualkv_compile.passes).

On Dynamo's graph, in order: checkpoint_inline, attention_rewrite, token_locality, lm_head,
position_tables.
On AOTAutograd's joint graph, before partitioning: attention_saving.
"""

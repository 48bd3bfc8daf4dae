"""FX graph passes run by the dualkv compile backend (installed as dualkv_compile.passes).

The attention-rewrite and token-dedup passes land with issue #3; nothing is exported yet.
"""

"""Command-line tools and benchmarks (installed as dualkv_compile.tools)."""

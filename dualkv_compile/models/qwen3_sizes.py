"""transformers' published Qwen3 shapes: the single source for the builders (qwen3.py) and
the CLI, which reads them without importing torch or torchtune."""

__all__ = ["QWEN3_SIZES", "QWEN3_VOCAB"]

QWEN3_SIZES = {
    "0.6b": dict(num_layers=28, num_heads=16, num_kv_heads=8, embed_dim=1024,
                 intermediate_dim=3072, head_dim=128, tie_word_embeddings=True),
    "1.7b": dict(num_layers=28, num_heads=16, num_kv_heads=8, embed_dim=2048,
                 intermediate_dim=6144, head_dim=128, tie_word_embeddings=True),
    "4b": dict(num_layers=36, num_heads=32, num_kv_heads=8, embed_dim=2560,
               intermediate_dim=9728, head_dim=128, tie_word_embeddings=True),
    "8b": dict(num_layers=36, num_heads=32, num_kv_heads=8, embed_dim=4096,
               intermediate_dim=12288, head_dim=128, tie_word_embeddings=False),
}
QWEN3_VOCAB = 151936

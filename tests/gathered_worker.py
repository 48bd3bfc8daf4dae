"""Run by tests/test_fsdp.py under torchrun (2 CPU processes, gloo): the recipe's rollout
helper `distributed.gathered` keeps a sharded decoder's parameters gathered between forwards
and reshards on exit; generation samples the same tokens either way. Prints one JSON line."""

import json

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dualkv_compile.models import qwen3
from dualkv_compile.rl import distributed as ddp
from dualkv_compile.rl import generate_groups


def main():
    ddp.init_distributed("cpu")
    torch.manual_seed(0)
    model = qwen3(vocab_size=50, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                  intermediate_dim=64, head_dim=8, max_seq_len=64).eval()
    ddp.shard_decoder(model)
    prompt = torch.randint(2, 50, (1, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    sharded = lambda: isinstance(model.layers[0].attn.q_proj.weight, DTensor)  # noqa: E731

    def sample():
        return generate_groups(model, prompt, samples=2, max_generated_tokens=6, pad_id=0,
                               rng=torch.Generator().manual_seed(3))

    plain = sample()
    after_plain = sharded()
    with ddp.gathered(model):
        inside = sample()
        during = sharded()
    after_exit = sharded()
    model(prompt)
    after_next = sharded()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({
            "same_tokens": bool(torch.equal(plain, inside)), "sharded_after_plain": after_plain,
            "sharded_inside": during, "sharded_after_exit": after_exit,
            "sharded_after_next_forward": after_next}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with torch.no_grad():
        main()

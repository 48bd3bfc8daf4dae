"""Rollout benchmark: sampling N responses of R tokens for G prompts of P tokens, bf16, one
process. Not a test.

    python -m dualkv_compile.tools.bench rollout --layers 8 --shapes 16,4096,256 --groups 1 2 4 8
    python -m dualkv_compile.tools.bench rollout --layers 36 --shapes 32,8192,1024 --no-hf

Variants, each timed after a warm-up call of the same shape (compiles and captures excluded):
- engine: RolloutEngine, prompt K/V once per group (cascade decode), CUDA graphs;
- engine_replicated: the same engine with the prompt K/V replicated per row (share_prompt=False),
  i.e. a decoder without cascade attention;
- hf_static_compiled: transformers' `generate` with its static cache, which compiles the
  forward itself (CompileConfig(fullgraph=True), mode="reduce-overhead"), on the replicated rows (same dims,
  its own random weights), sampling with top_k=0 and min_new_tokens = the steps timed;
- torchtune_kv_cache: the previous `generate_groups` (torchtune's KV cache, the prompt
  prefilled once and copied to every row, eager).
Decode ms/step = (time of R tokens - time of 1 token) / (R - 1); the baselines time
`--baseline-steps` tokens instead of R when fewer (their cost grows with position, so this
favours them). The floor is the bytes one decode step must read (weights and LM head, the
prompt K/V once per group or per row, the responses' K/V at their mean length) over the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import time

import torch

from dualkv_compile.models import qwen3_8b
from dualkv_compile.models.qwen3_sizes import QWEN3_SIZES, QWEN3_VOCAB
from dualkv_compile.rollout import RolloutEngine
from dualkv_compile.tools._common import (OneLineParser, add_out_argument, add_shapes_argument,
                                          check_out_path, environment, positive_int, save_progress,
                                          write_results)
from dualkv_compile.tools.models import CliError

MAX_SEQ_LEN = 16384  # the positions both models are built with: P + R at most


def _copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(2 ** 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 10 / (time.perf_counter() - t0)


def _timed(fn, repeats: int = 2) -> float:
    """Seconds of the fastest of `repeats` calls."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _per_step(run, steps: int) -> dict:
    """Warm up and time run(1) and run(steps): prefill s, decode ms/step, peak GiB."""
    run(1)
    t1 = _timed(lambda: run(1), 3)
    run(steps)  # warm-up: compile / capture this shape
    torch.cuda.reset_peak_memory_stats()
    tn = _timed(lambda: run(steps))
    return {"prefill_s": t1, "total_s": tn, "steps": steps,
            "decode_ms": 1e3 * (tn - t1) / max(steps - 1, 1),
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30}


def _floor_bytes(model, layers, rows, groups, p, r, shared: bool) -> dict:
    dims = QWEN3_SIZES["8b"]
    kv_token = layers * 2 * dims["num_kv_heads"] * dims["head_dim"] * 2  # K and V, bf16
    weights = sum(q.numel() * q.element_size() for name, q in model.named_parameters()
                  if not name.startswith("tok_embeddings"))
    prompt = kv_token * p * (groups if shared else rows)
    responses = kv_token * rows * r / 2
    return {"weights": weights, "prompt_kv": prompt, "response_kv": responses,
            "total": weights + prompt + responses}


def _hf_model(layers: int):
    import transformers as tf

    d = QWEN3_SIZES["8b"]
    cfg = tf.Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=d["embed_dim"],
                         intermediate_size=d["intermediate_dim"], num_hidden_layers=layers,
                         num_attention_heads=d["num_heads"], num_key_value_heads=d["num_kv_heads"],
                         head_dim=d["head_dim"], max_position_embeddings=MAX_SEQ_LEN,
                         tie_word_embeddings=False)
    with torch.device("cuda"):
        model = tf.Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa")
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    # generate() compiles the forward itself for a static cache on CUDA (its CompileConfig:
    # mode="reduce-overhead"); wrapping forward in torch.compile as well breaks its graphs
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = tf.CompileConfig(fullgraph=True)
    return model


def _hf_run(model, prompts, n):
    rows = prompts.repeat_interleave(n, 0)

    def run(steps):
        with torch.no_grad():
            model.generate(rows, attention_mask=torch.ones_like(rows), max_new_tokens=steps,
                           min_new_tokens=steps, do_sample=True, top_k=0, temperature=1.0,
                           pad_token_id=0)
    return run


def _torchtune_kv_cache_generate(model, prompts, samples, t, rng):
    """The previous generate_groups: torchtune's KV cache, prompt prefilled once per group and
    copied into every row's cache, each step the model's forward over the whole static cache
    with an explicit mask (no early stop: random weights never stop)."""
    from torchtune.generation import (get_causal_mask_from_padding_mask,
                                      get_position_ids_from_padding_mask, sample)
    from torchtune.modules.common_utils import local_kv_cache

    g, p = prompts.shape
    valid = torch.nn.functional.pad(prompts != 0, (0, t), value=True)
    masks = get_causal_mask_from_padding_mask(valid, target_seq_len=p + t)
    positions = get_position_ids_from_padding_mask(valid)
    rows = torch.arange(g, device=prompts.device).repeat_interleave(samples)
    dtype = torch.bfloat16
    with local_kv_cache(model, batch_size=g, device=prompts.device, dtype=dtype,
                        decoder_max_seq_len=p + t):
        logits = model(prompts, input_pos=positions[:, :p], mask=masks[:, :p])[:, -1]
        kv = [(layer.attn.kv_cache.k_cache[:, :, :p].clone(),
               layer.attn.kv_cache.v_cache[:, :, :p].clone()) for layer in model.layers]
    with local_kv_cache(model, batch_size=g * samples, device=prompts.device, dtype=dtype,
                        decoder_max_seq_len=p + t):
        for layer, (k, v) in zip(model.layers, kv):
            layer.attn.kv_cache.k_cache[:, :, :p] = k[rows]
            layer.attn.kv_cache.v_cache[:, :, :p] = v[rows]
            layer.attn.kv_cache.cache_pos.add_(p)
        cols = torch.arange(p + t, device=prompts.device)
        step_masks = ((cols[None, :] <= (p + torch.arange(t, device=prompts.device))[:, None])
                      [None] & valid[:, None, :])[rows]
        q = lambda x: torch.empty_like(x, dtype=torch.float32).exponential_(1, generator=rng)  # noqa: E731
        logits = logits[rows].float()
        tokens = sample(logits, q=q(logits))
        for step in range(t - 1):
            logits = model(tokens, input_pos=positions[rows][:, p + step:p + step + 1],
                           mask=step_masks[:, step:step + 1])[:, -1].float()
            tokens = sample(logits, q=q(logits))


def _profile(model, prompts, n, r, shared, attention, path):
    """The CUDA kernels of one rollout of R tokens as the engine runs it (compiled, replayed
    as CUDA graphs), after a warm-up of the same shape; totals over the R steps."""
    from torch.profiler import ProfilerActivity, profile

    engine = RolloutEngine(model, share_prompt=shared, attention=attention)
    run = lambda: engine.generate(prompts, group_size=n, max_generated_tokens=r, pad_id=0)  # noqa: E731
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    table = prof.key_averages()
    total_ms = sum(e.self_device_time_total for e in table) / 1e3
    with open(path, "w") as f:
        f.write(f"kernels: {total_ms:.1f} ms over {r} steps (prefill included), "
                f"{total_ms / r:.3f} ms a step\n")
        f.write(table.table(sort_by="self_cuda_time_total", row_limit=40,
                            max_name_column_width=100))


def main(argv=None, prog=None):
    """`prog` names the benchmark in its usage and errors (default: the script's name)."""
    ap = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_shapes_argument(ap, ["16,4096,256"])
    ap.add_argument("--layers", type=positive_int, default=8)
    ap.add_argument("--groups", type=positive_int, nargs="+", default=[1],
                    help="prompts per call")
    ap.add_argument("--baseline-steps", type=positive_int, default=128)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--no-torchtune", action="store_true", help="skip the previous sampler")
    ap.add_argument("--no-replicated", action="store_true")
    ap.add_argument("--attention", nargs="+", default=["triton"],
                    choices=["triton", "flex", "math"],
                    help="decode attention of the shared-prompt engine (each one a variant)")
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="write the top CUDA kernels of one rollout of R tokens (compiled, "
                         "CUDA graphs) of each engine variant to PATH_<variant>_...txt")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    for n, p, r in args.shapes:  # else the first call past it fails, after the others ran
        if p + r > MAX_SEQ_LEN:
            ap.error(f"--shapes {n},{p},{r}: P + R = {p + r} positions, more than the models' "
                     f"{MAX_SEQ_LEN}")
    if args.profile:  # written after the timings: its directory is checked first
        try:
            check_out_path(f"{args.profile}_engine.txt", folder=False)
        except CliError as e:
            ap.error(f"--profile {args.profile}: {e}")
    if not torch.cuda.is_available():
        ap.error("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = qwen3_8b(num_layers=args.layers, max_seq_len=MAX_SEQ_LEN)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    bandwidth = _copy_bandwidth()
    hf = None if args.no_hf else _hf_model(args.layers)
    meta = environment() | {"layers": args.layers, "dtype": "bfloat16",
                            "copy_bandwidth_gbs": bandwidth / 1e9, "model": "qwen3-8b shaped",
                            "baseline_steps": args.baseline_steps}
    rows_out = []

    def add(row):
        rows_out.append(row)
        save_progress(args.out, meta, rows_out, _table(rows_out, args.layers, bandwidth))
    for n, p, r in args.shapes:
        for groups in args.groups:
            prompts = torch.randint(2, QWEN3_VOCAB, (groups, p), device="cuda")
            variants = {f"engine_{a}": (True, a) for a in args.attention}
            if not args.no_replicated:
                variants["engine_replicated"] = (False, args.attention[0])
            for name, (shared, attention) in variants.items():
                if args.profile:
                    _profile(model, prompts, n, r, shared, attention,
                             f"{args.profile}_{name}_{n}_{p}_{r}_{groups}.txt")
                engine = RolloutEngine(model, share_prompt=shared, attention=attention)
                gen = torch.Generator("cuda").manual_seed(0)
                # engine bound as a default: the `del engine` below read as an undefined name
                result = _per_step(lambda t, engine=engine: engine.generate(
                    prompts, group_size=n, max_generated_tokens=t, pad_id=0, rng=gen), r)
                floor = _floor_bytes(model, args.layers, groups * n, groups, p, r, shared)
                result |= {"kv_gib": engine.kv_bytes() / 2 ** 30,
                           "compiled_functions": engine.stats["compiled_functions"],
                           "captures": engine.stats["captures"],
                           "graph_fallbacks": engine.stats["graph_fallbacks"]}
                add(_row(name, n, p, r, groups, result, floor, bandwidth))
                del engine
                torch.cuda.empty_cache()
            steps = min(r, args.baseline_steps)
            if hf is not None:
                result = _per_step(_hf_run(hf, prompts, n), steps)
                floor = _floor_bytes(model, args.layers, groups * n, groups, p, steps, False)
                add(_row("hf_static_compiled", n, p, r, groups, result, floor, bandwidth))
                torch.cuda.empty_cache()
            if not args.no_torchtune:
                gen = torch.Generator("cuda").manual_seed(0)
                result = _per_step(lambda t: _torchtune_kv_cache_generate(
                    model, prompts, n, t, gen), steps)
                floor = _floor_bytes(model, args.layers, groups * n, groups, p, steps, False)
                add(_row("torchtune_kv_cache", n, p, r, groups, result, floor, bandwidth))
                torch.cuda.empty_cache()
    write_results(args.out, meta, rows_out, _table(rows_out, args.layers, bandwidth))


def _row(name, n, p, r, groups, result, floor, bandwidth):
    floor_ms = 1e3 * floor["total"] / bandwidth
    rows = groups * n
    return {"variant": name, "N": n, "P": p, "R": r, "groups": groups, "rows": rows,
            **result, "floor_bytes": floor, "floor_ms": floor_ms,
            "decode_over_floor": result["decode_ms"] / floor_ms,
            "tokens_per_s": rows * result["steps"] / result["total_s"]}


def _table(rows, layers, bandwidth) -> str:
    """The rows as markdown. A baseline runs `steps` < R decode steps (--baseline-steps): its
    tokens/s spreads the prefill over fewer tokens than the engine's and is no comparison;
    decode ms/step is (its floor: the response K/V at the mean of the steps run)."""
    lines = [f"Rollout, {layers} Qwen3-8B-shaped layers, bf16; copy bandwidth "
             f"{bandwidth / 1e9:.0f} GB/s; tokens/s over the steps run (compare rows by "
             "decode ms/step where the steps differ)\n",
             "| variant | N | P | R | steps run | groups | prefill s | decode ms/step | floor ms | "
             "x floor | tokens/s | peak GiB | KV GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {x['variant']} | {x['N']} | {x['P']} | {x['R']} | {x['steps']} | "
                     f"{x['groups']} | "
                     f"{x['prefill_s']:.3f} | {x['decode_ms']:.2f} | {x['floor_ms']:.2f} | "
                     f"{x['decode_over_floor']:.2f} | {x['tokens_per_s']:.0f} | "
                     f"{x['peak_gib']:.1f} | {x.get('kv_gib', float('nan')):.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

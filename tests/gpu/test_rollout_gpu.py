"""GPU: the rollout engine compiled and replayed as CUDA graphs.

- A graph replay samples exactly what the same compiled step launched eagerly samples, also
  with several stop tokens.
- Shorter prompts replay the graphs of the held, larger workspace, sampling what eager steps
  sample.
- An in-place weight update (an optimizer step) is seen by the next rollout without a capture.
- The Triton kernels' and flex's decode attention in bf16 are within the math path's own bf16
  error of float64; in fp32 (the kernels' IEEE dots) the kernels give float64's answer to fp32
  rounding, with runs of 64 keys a prompt program and with one run per split.
- The engine's bf16 logprobs against optimize().response_logprobs on the sampled tokens:
  the gap is printed (and bounded loosely; the figure goes to docs/performance.md).
- A generator on another device is refused.
Run: pytest -m gpu -s tests/gpu/test_rollout_gpu.py
"""

import pytest
import torch

import dualkv_compile as dk
from dualkv_compile.models import qwen3
from dualkv_compile.rollout import RolloutEngine, decode_attention

pytestmark = pytest.mark.gpu
PAD, EOS, VOCAB = 0, 1, 512


def model(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    m = qwen3(vocab_size=VOCAB, num_layers=3, num_heads=8, num_kv_heads=2, embed_dim=256,
              intermediate_dim=512, head_dim=32, max_seq_len=2048, init_std=0.05)
    return m.to("cuda", dtype).eval()


def prompts(groups=3, width=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(2, VOCAB, (groups, width), generator=g)
    for i in range(1, groups):
        p[i, :57 * i] = PAD  # lengths 300, 243, 186: left-padded, ragged
    return p.cuda()


def run(engine, p, seed=3, **kw):
    args = dict(group_size=4, max_generated_tokens=40, pad_id=PAD, stop_tokens=EOS, top_p=0.95,
                rng=torch.Generator("cuda").manual_seed(seed)) | kw
    return engine.generate(p, **args)


@pytest.mark.parametrize("attention", ["auto", "flex"])  # auto: the Triton kernels
def test_graph_replay_equals_the_eagerly_launched_step(attention):
    m, p = model(), prompts()
    graphs = RolloutEngine(m, steps_per_graph=8, attention=attention)
    eager = RolloutEngine(m, cuda_graphs=False, attention=attention)
    a, b = run(graphs, p), run(eager, p)
    assert graphs.stats["captures"] >= 1 and eager.stats["captures"] == 0
    assert graphs.stats["graph_fallbacks"] == 0
    assert torch.equal(a, b)
    assert len({tuple(r) for r in a.tolist()}) > 6
    # a second call (a new generator, same seed) reuses the compiled step and the graphs
    compiled, captures = graphs.stats["compiled_functions"], graphs.stats["captures"]
    assert torch.equal(run(graphs, p), a)
    assert (graphs.stats["compiled_functions"], graphs.stats["captures"]) == (compiled, captures)


@pytest.mark.parametrize("attention", ["auto", "flex"])
def test_shorter_prompts_replay_the_held_graphs(attention):
    # prompts of bucket 224 in the workspace made for bucket 320: no new cache or capture, and
    # the replays sample what the same step launched eagerly samples
    m, long, short = model(seed=5), prompts(), prompts(width=200, seed=6)
    graphs = RolloutEngine(m, steps_per_graph=8, attention=attention)
    eager = RolloutEngine(m, cuda_graphs=False, attention=attention)
    run(graphs, long), run(eager, long)
    captures = graphs.stats["captures"]
    a, b = run(graphs, short), run(eager, short)
    assert (graphs.stats["captures"], graphs.stats["workspaces"]) == (captures, 1)
    assert eager.stats["workspaces"] == 1 and graphs.stats["graph_fallbacks"] == 0
    assert torch.equal(a, b)


def test_several_stop_tokens_in_a_captured_step():
    # every 16th id stops a response (as IdTokenizer(stop_every=16) does): most rows end early
    m, p, stops = model(seed=4), prompts(), list(range(1, VOCAB, 16))
    graphs = RolloutEngine(m, steps_per_graph=8)
    a = run(graphs, p, stop_tokens=stops)
    b = run(RolloutEngine(m, cuda_graphs=False), p, stop_tokens=stops)
    assert graphs.stats["captures"] >= 1 and graphs.stats["graph_fallbacks"] == 0
    assert torch.equal(a, b)
    is_stop = torch.isin(a, torch.tensor(stops, device=a.device))
    assert is_stop.any(1).float().mean() > 0.5
    first = torch.where(is_stop.any(1), is_stop.int().argmax(1), a.shape[1])
    after = torch.arange(a.shape[1], device=a.device)[None] > first[:, None]
    assert (a[after] == PAD).all()


def test_release_returns_the_cache_and_graph_memory():
    # after release() the KV cache and the graphs' private pool are no longer allocated (the
    # policy update can use them); the next call captures again and samples the same
    m, p = model(seed=7), prompts()
    engine = RolloutEngine(m, steps_per_graph=8)
    first = run(engine, p)
    torch.cuda.synchronize()
    held, kv = torch.cuda.memory_allocated(), engine.kv_bytes()
    captures = engine.stats["captures"]
    engine.release()
    torch.cuda.synchronize()
    assert held - torch.cuda.memory_allocated() >= kv > 0
    assert torch.equal(run(engine, p), first)
    assert engine.stats["captures"] == 2 * captures and engine.stats["workspaces"] == 2


def test_two_call_shapes_replay_their_own_graphs():
    # calls of 3 groups and of 2 alternate: each shape keeps its workspace and graphs (captured
    # once), and the replays sample what the eagerly launched steps sample
    m, three, two = model(seed=8), prompts(), prompts(groups=2, seed=9)
    graphs = RolloutEngine(m, steps_per_graph=8)
    eager = RolloutEngine(m, cuda_graphs=False)
    for i, p in enumerate([three, two, three, two]):
        assert torch.equal(run(graphs, p, seed=i), run(eager, p, seed=i)), i
        if i == 1:
            captures = graphs.stats["captures"]
    assert graphs.stats["captures"] == captures and graphs.stats["workspaces"] == 2
    assert graphs.stats["graph_fallbacks"] == 0


def test_in_place_weight_update_is_seen_without_recapture():
    m, p = model(seed=2), prompts()
    engine = RolloutEngine(m, steps_per_graph=8)
    before = run(engine, p)
    captures = engine.stats["captures"]
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for q in m.parameters():
        q.grad = torch.randn_like(q)
    opt.step()  # in place, as AdamW's foreach/fused steps are
    after = run(engine, p)
    assert engine.stats["captures"] == captures
    assert not torch.equal(before, after)
    assert torch.equal(after, run(RolloutEngine(m, cuda_graphs=False), p))


# 16 rows x 4 query heads a kv head: one query tile of 64; 32 x 4: flex's two tiles of 64, one
# prompt-kernel tile of 128; 48 x 4: two prompt-kernel tiles
@pytest.mark.parametrize("implementation", ["triton", "flex"])
@pytest.mark.parametrize("n,r,at", [(16, 300, 123), (32, 300, 123), (32, 256, 255),
                                    (48, 100, 50)])
def test_decode_attention_bf16_error_is_the_math_paths(implementation, n, r, at):
    g = torch.Generator("cuda").manual_seed(0)
    groups, hq, hkv, d, plen = 3, 32, 8, 128, 1000
    x = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float64)  # noqa: E731
    q, pk, pv = x(groups * n, hq, d), x(groups, hkv, plen, d), x(groups, hkv, plen, d)
    rk, rv = x(groups * n, hkv, r, d), x(groups * n, hkv, r, d)
    lens, last = torch.tensor([1000, 1, 517], device="cuda"), torch.tensor(at, device="cuda")
    # the cache's split layout: [G, S, Hkv, C, D], 8 splits of 125 keys
    pk, pv = (t.view(groups, hkv, 8, plen // 8, d).transpose(1, 2).contiguous() for t in (pk, pv))
    exact = decode_attention(q, pk, pv, lens, rk, rv, last, scale=d ** -0.5)
    lo = [t.bfloat16() for t in (q, pk, pv)]
    rlo = [t.bfloat16() for t in (rk, rv)]
    torch._dynamo.reset()  # static shapes for each case, as the engine compiles it
    fast = torch.compile(decode_attention, fullgraph=True, dynamic=False)
    got = fast(*lo, lens, *rlo, last, scale=d ** -0.5, implementation=implementation).double()
    math = decode_attention(*lo, lens, *rlo, last, scale=d ** -0.5).double()
    err_fast, err_math = (got - exact).abs().max(), (math - exact).abs().max()
    print(f"\ndecode attention bf16 max error: {implementation} {err_fast:.3e}, "
          f"math {err_math:.3e}")
    assert err_fast <= 2 * err_math


# 132: prompt runs of 64 keys (two a 125-key split); 1: one run of 128 keys a split
@pytest.mark.parametrize("min_programs", [132, 1])
def test_triton_kernels_are_exact_in_fp32(monkeypatch, min_programs):
    """In float32 (the kernels' IEEE dots) the Triton decode attention is float64's answer to
    float32 rounding; the engine's default on CUDA."""
    from dualkv_compile.rollout import kernels
    from dualkv_compile.rollout.kernels import prompt as prompt_kernel

    monkeypatch.setattr(prompt_kernel, "_MIN_PROGRAMS", min_programs)
    g = torch.Generator("cuda").manual_seed(1)
    groups, n, hq, hkv, d, plen, r = 2, 16, 32, 8, 128, 1000, 300
    x = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float64)  # noqa: E731
    split = (groups, 8, hkv, plen // 8, d)  # the cache's layout: 8 splits of 125 keys
    q, pk, pv = x(groups * n, hq, d), x(*split), x(*split)
    rk, rv = x(groups * n, hkv, r, d), x(groups * n, hkv, r, d)
    lens, last = torch.tensor([1000, 517], device="cuda"), torch.tensor(200, device="cuda")
    exact = decode_attention(q, pk, pv, lens, rk, rv, last, scale=d ** -0.5)
    for dtype in (torch.bfloat16, torch.float32):
        assert kernels.supports(*(t.to(dtype) for t in (q, pk, pv, rk, rv)))
    lo = [t.float() for t in (q, pk, pv)]
    torch._dynamo.reset()
    fast = torch.compile(decode_attention, fullgraph=True, dynamic=False)
    got = fast(*lo, lens, rk.float(), rv.float(), last, scale=d ** -0.5, implementation="triton")
    err = float((got.double() - exact).abs().max())
    print(f"\ntriton decode attention fp32, min_programs {min_programs}: max error {err:.3e}")
    assert err < 1e-4


def test_engine_logprobs_against_response_logprobs():
    m, p = model(seed=4), prompts()
    tokens, lp = run(RolloutEngine(m), p, return_logprobs=True, top_p=None, temperature=0.9)
    batch = torch.cat([p.repeat_interleave(4, 0), tokens], 1)
    is_stop = tokens == EOS
    valid = (is_stop.cumsum(1) - is_stop.long()) == 0
    mask = torch.cat([p.repeat_interleave(4, 0) != PAD, valid], 1)
    ref = dk.optimize(m).response_logprobs(batch, prompt_len=p.shape[1], padding_mask=mask,
                                           temperature=0.9)
    gap = (lp - ref.float())[valid].abs()
    print(f"\nengine vs response_logprobs, bf16: max |gap| {gap.max():.3e}, mean {gap.mean():.3e} "
          f"over {int(valid.sum())} tokens")
    assert gap.mean() < 0.05


def test_the_callers_generator_advances_as_in_eager_decoding():
    m, p = model(seed=5), prompts()
    g1, g2 = torch.Generator("cuda").manual_seed(11), torch.Generator("cuda").manual_seed(11)
    run(RolloutEngine(m, steps_per_graph=8), p, rng=g1, stop_tokens=None)
    run(RolloutEngine(m, cuda_graphs=False), p, rng=g2, stop_tokens=None)
    assert torch.equal(g1.get_state(), g2.get_state())
    assert torch.equal(torch.rand(4, device="cuda", generator=g1),
                       torch.rand(4, device="cuda", generator=g2))


def test_generator_on_another_device_is_refused():
    with pytest.raises(ValueError, match="rng is on cpu"):
        RolloutEngine(model()).generate(prompts(), group_size=2, max_generated_tokens=3,
                                        pad_id=PAD, rng=torch.Generator())

"""FP8 KV caches (kv_cache_dtype "fp8" = e4m3, "fp8_e5m2"): the torch reference and the CPU path
against float64 attention over explicitly dequantised keys, and every Triton kernel that writes or
reads the cache (KV write, RoPE launch's write, split-KV decode, varlen prefill, unified, MLA's
latent write and decode, the MLA layer's GPU path) against the reference on the same FP8 cache.

Scales are not 1 (K_SCALE, V_SCALE), so a kernel that drops or inverts one fails. Without a GPU
the kernels run under TRITON_INTERPRET=1 (tests/kernels/conftest.py) on tiny shapes; on a GPU the
same tests run there, plus Qwen3-30B-A3B / DeepSeek-V3 shapes in bf16 and a CUDA-graph replay of
the FP8 decode (the `needs_cuda` tests at the end).
Legend: T query tokens, B sequences, H query heads, G KV heads, d head dim, N blocks, S block size,
R kv_lora_rank, P rope dims, C = R + P.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

import models.layers.mla_attention as mla_layer  # noqa: E402
from kernels.attention import (  # noqa: E402
    AttentionMetadata,
    dequantize_kv,
    paged_attention_torch,
    quantize_kv,
    round_trip_kv,
    write_kv_cache,
)
from kernels.cpu_attention import paged_attention_cpu  # noqa: E402
from kernels.mla_attention import mla_absorbed_torch, write_latent_cache  # noqa: E402
from kernels.triton_attention.decode import paged_attention_decode_triton  # noqa: E402
from kernels.triton_attention.kv_cache import write_kv_cache_triton  # noqa: E402
from kernels.triton_attention.mla_decode import mla_decode_triton, write_latent_cache_triton  # noqa: E402
from kernels.triton_attention.prefill import paged_attention_prefill_triton  # noqa: E402
from kernels.triton_attention.unified import unified_attention_triton  # noqa: E402
from kernels.triton_fused.rope import qk_norm_rope_triton, rope_triton  # noqa: E402
from models.config import RopeConfig  # noqa: E402
from models.layers.mla_attention import MLAAttention, MLAConfig  # noqa: E402
from models.layers.rotary import get_rope  # noqa: E402
from tests.factories_deepseek import mla_step_metadata  # noqa: E402
from tests.kernels.attention_cases import dense_attention, paged_batch  # noqa: E402
from tests.kernels.triton_marks import DEV, needs_cuda, needs_triton_device  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
K_SCALE, V_SCALE = 0.05, 3.0  # keys ~N(0, 1) stored up to ~80, values below 1: both well inside the range
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}  # several key tiles per sequence
# decode rows (one on a block edge, one of a single token), a fresh prompt, chunked prefills over
# cached context (mid-block and on a block edge), a sequence with no query this step
MIXED = [(15, 1), (0, 1), (9, 7), (16, 11), (0, 13), (32, 1), (5, 0), (20, 6)]
DECODES = [(15, 1), (0, 1), (33, 1), (7, 1), (60, 1)]


def quantize_cache(cache_2NSGd, dtype):
    """The float cache as an FP8 one holds it (K with K_SCALE, V with V_SCALE)."""
    return torch.stack((quantize_kv(cache_2NSGd[0], dtype, K_SCALE), quantize_kv(cache_2NSGd[1], dtype, V_SCALE)))


def explicit_reference(batch, dtype, chunk, rt=True):
    """float64 attention over each sequence's keys dequantised by hand (rt=False: unquantised)."""
    outs = []
    for q, k, v in batch.contexts:
        if q.shape[0]:
            if rt:
                k, v = round_trip_kv(k, dtype, K_SCALE), round_trip_kv(v, dtype, V_SCALE)
            outs.append(dense_attention(q, k, v, batch.scale, chunk=chunk))
    return torch.cat(outs).float()


def reference(batch, cache8, chunk=None):
    """The torch reference on the FP8 cache (on the CPU)."""
    return paged_attention_torch(batch.q, batch.k_new, batch.v_new, cache8, batch.meta, batch.scale, chunk,
                                 k_scale=K_SCALE, v_scale=V_SCALE)


def device_layout(batch):
    meta = batch.meta
    return (meta.block_tables_BM.to(DEV), torch.tensor(meta.query_start_loc, dtype=torch.int32, device=DEV),
            torch.tensor(meta.seq_lens, dtype=torch.int32, device=DEV))


# --- quantisation and the torch reference ---------------------------------------------------------

@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates_and_rounds_as_torch(dtype):
    fmax = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1.0, -3.3, 1e9, -1e9, fmax * 0.5, 1e-9])
    q = quantize_kv(x, dtype, 0.5)
    assert q.dtype == dtype
    assert torch.equal(q.float(), (x / 0.5).clamp(-fmax, fmax).to(dtype).float())
    assert q.float()[3] == fmax and q.float()[4] == -fmax  # saturated, not NaN
    back = dequantize_kv(q, torch.float32, 0.5)
    assert back[3] == fmax * 0.5 and back[1] == 1.0
    # within half an fp8 ulp (3 / 2 mantissa bits) where normal
    y = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    normal = y.abs() / K_SCALE >= torch.finfo(dtype).smallest_normal
    rel = ((round_trip_kv(y, dtype, K_SCALE) - y).abs() / y.abs())[normal].max()
    assert rel <= 2.0 ** -(4 if dtype == torch.float8_e4m3fn else 3) + 1e-6
    assert torch.equal(round_trip_kv(y, torch.float32, K_SCALE), y)  # other caches: unchanged


@pytest.mark.parametrize("dtype", FP8)
def test_reference_write_stores_quantised_bytes(dtype):
    T, G, d, N, S = 6, 2, 8, 4, 4
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(T, G, d, generator=g) * 30, torch.randn(T, G, d, generator=g)
    slots = torch.tensor([3, 9, 0, 15, 7, 12])
    cache = torch.zeros(2, N, S, G, d, dtype=dtype)
    write_kv_cache(k, v, cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    flat = cache.view(2, N * S, G, d)
    assert torch.equal(flat[0, slots].view(torch.uint8), quantize_kv(k, dtype, K_SCALE).view(torch.uint8))
    assert torch.equal(flat[1, slots].view(torch.uint8), quantize_kv(v, dtype, V_SCALE).view(torch.uint8))
    others = torch.ones(N * S, dtype=torch.bool)
    others[slots] = False
    assert (flat[:, others].view(torch.uint8) == 0).all()
    assert (flat[0, slots].float().abs().max() == torch.finfo(dtype).max) == (dtype == torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize("attend", [paged_attention_torch, paged_attention_cpu])
def test_torch_paths_read_fp8(dtype, chunk, attend):
    """The reference and the CPU fast path over an FP8 cache equal float64 attention over keys
    dequantised by hand, and differ from the unquantised attention (the cache is really FP8)."""
    batch = paged_batch(MIXED, 4, H=4, G=2, d=8, seed=3)
    cache8 = quantize_cache(batch.cache, dtype)
    out = attend(batch.q, batch.k_new, batch.v_new, cache8, batch.meta, batch.scale, chunk,
                 k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out, explicit_reference(batch, dtype, chunk), atol=1e-5, rtol=1e-5)
    assert (out - explicit_reference(batch, dtype, chunk, rt=False)).abs().max() > 1e-3


# --- Triton: writes ------------------------------------------------------------------------------

@needs_triton_device
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_triton_write_equals_reference_bytes(dtype, src_dtype):
    """Bit for bit the reference's quantisation (on the GPU the cast rounds; under the interpreter
    the kernel rounds onto the FP8 grid first), saturated values and -1 slots included."""
    T, H, G, d, N, S = 9, 4, 2, 24, 6, 4
    g = torch.Generator().manual_seed(2)
    qkv = (torch.randn(T, (H + 2 * G) * d, generator=g) * torch.logspace(-4, 2.5, (H + 2 * G) * d)).to(src_dtype)
    k = qkv[:, H * d:(H + G) * d].view(T, G, d)  # strided views, as split from a fused qkv
    v = qkv[:, (H + G) * d:].view(T, G, d)
    slots = torch.randperm(N * S, generator=g)[:T]
    slots[[2, 5]] = -1
    keep = slots >= 0
    want = torch.zeros(2, N, S, G, d, dtype=dtype)
    write_kv_cache(k[keep], v[keep], want, slots[keep], k_scale=K_SCALE, v_scale=V_SCALE)
    cache = torch.zeros(2, N, S, G, d, dtype=dtype, device=DEV)
    write_kv_cache_triton(k.to(DEV), v.to(DEV), cache, slots.to(DEV), k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(cache.cpu().view(torch.uint8), want.view(torch.uint8))


@needs_triton_device
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("norm", [True, False])
def test_rope_launch_writes_fp8_as_the_separate_write(dtype, norm):
    T, H, G, d, rot, max_pos = 5, 4, 2, 16, 10, 64
    rope = get_rope(d, max_pos, RopeConfig(theta=10000.0), rot, True).to(DEV)
    g = torch.Generator().manual_seed(4)
    qkv = (torch.randn(T, (H + 2 * G) * d, generator=g) * 5).to(DEV)
    q, k, v = (x.reshape(T, -1, d) for x in qkv.split([H * d, G * d, G * d], -1))
    pos = torch.tensor([3, 63, 0, 17, 40], device=DEV)
    slots = torch.tensor([7, 0, -1, 12, 3], device=DEV)
    w = [(1 + 0.3 * torch.randn(d, generator=g)).to(DEV) for _ in range(2)]
    fused, separate = (torch.zeros(2, 4, 4, G, d, dtype=dtype, device=DEV) for _ in range(2))
    kv = dict(v_TGd=v, kv_cache_2NSGd=fused, slot_mapping_T=slots, k_scale=K_SCALE, v_scale=V_SCALE)
    if norm:
        _, k_out = qk_norm_rope_triton(pos, q, k, w[0], w[1], 1e-6, rope.cos_cache, rope.sin_cache, rot, True, **kv)
    else:
        _, k_out = rope_triton(pos, q, k, rope.cos_cache, rope.sin_cache, rot, True, **kv)
    write_kv_cache_triton(k_out, v, separate, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(fused.view(torch.uint8), separate.view(torch.uint8))
    assert fused.view(torch.uint8).any()


# --- Triton: attention reads ------------------------------------------------------------------------

@needs_triton_device
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("splits,fused", [(1, None), (3, True), (3, False)])
def test_decode_kernel_reads_fp8(dtype, chunk, splits, fused):
    batch = paged_batch(DECODES, 4, H=8, G=2, d=16, seed=5, stale_cache=True)
    cache8 = quantize_cache(batch.cache, dtype)
    tables, _, lens = device_layout(batch)
    out = paged_attention_decode_triton(batch.q.to(DEV), cache8.to(DEV), tables, lens, batch.scale, chunk,
                                        num_splits=splits, block_n=16, fused_merge=fused,
                                        k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.cpu(), reference(batch, cache8, chunk), atol=1e-5, rtol=1e-5)


@needs_triton_device
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("chunk", [None, 8])
def test_prefill_kernel_reads_fp8(dtype, chunk):
    batch = paged_batch(MIXED, 4, H=4, G=2, d=16, seed=6, stale_cache=True)
    cache8 = quantize_cache(batch.cache, dtype)
    tables, qsl, lens = device_layout(batch)
    max_q = max(n for _, n in MIXED)
    out = paged_attention_prefill_triton(batch.q.to(DEV), cache8.to(DEV), tables, qsl, lens, max_q, batch.scale,
                                         chunk, config=SMALL, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.cpu(), reference(batch, cache8, chunk), atol=1e-5, rtol=1e-5)


@needs_triton_device
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("chunk,apart", [(None, False), (8, False), (None, True)])
def test_unified_kernel_reads_fp8(dtype, chunk, apart):
    batch = paged_batch(MIXED, 4, H=8, G=2, d=16, seed=7, stale_cache=True)
    cache8 = quantize_cache(batch.cache, dtype)
    tables, qsl, lens = device_layout(batch)
    out = unified_attention_triton(batch.q.to(DEV), cache8.to(DEV), tables, qsl, lens, batch.scale, chunk,
                                   config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}, decodes_apart=apart,
                                   k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.cpu(), reference(batch, cache8, chunk), atol=1e-5, rtol=1e-5)


@needs_triton_device
def test_kernels_ignore_scales_of_other_caches():
    """Scales only act on FP8 caches: a float cache reads the same with or without them."""
    batch = paged_batch(DECODES, 4, H=4, G=2, d=16, seed=8)
    tables, _, lens = device_layout(batch)
    args = (batch.q.to(DEV), batch.cache.to(DEV), tables, lens, batch.scale)
    torch.testing.assert_close(paged_attention_decode_triton(*args, k_scale=K_SCALE, v_scale=V_SCALE),
                               paged_attention_decode_triton(*args), atol=0, rtol=0)


# --- MLA ------------------------------------------------------------------------------------------

def latent_inputs(lens, S, C, seed):
    """(latent rows [sum(lens), C], their slots, block tables [B, M]) with scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    per = [max(1, -(-L // S)) for L in lens]
    N = sum(per) + 3
    perm = torch.randperm(N, generator=g).tolist()
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
    slots = []
    for b, L in enumerate(lens):
        blocks = [perm.pop() for _ in range(per[b])]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // S] * S + p % S for p in range(L)]
    rows = torch.randn(len(slots), C, generator=g) * 4
    return rows, torch.tensor(slots), tables, N


@needs_triton_device
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("splits", [1, 3])
def test_mla_write_and_decode_read_fp8(dtype, splits):
    lens, S, H, R, P = [5, 17, 1, 33, 0], 4, 3, 20, 8
    rows, slots, tables, N = latent_inputs(lens, S, R + P, seed=9)
    scale, kv_scale = (16 + P) ** -0.5, 0.3
    want = torch.zeros(N, S, R + P, dtype=dtype)
    write_latent_cache(rows, want, slots, kv_scale)
    assert torch.equal(want.view(-1, R + P)[slots].view(torch.uint8),
                       quantize_kv(rows, dtype, kv_scale).view(torch.uint8))
    cache = torch.zeros(N, S, R + P, dtype=dtype, device=DEV)
    spare = next(n for n in range(N) if n not in set(tables.flatten().tolist()))  # a block no sequence reads
    pad = torch.tensor([-1, spare * S + 1])  # a skipped row and a row there
    write_latent_cache_triton(torch.cat((rows, torch.randn(2, R + P))).to(DEV), cache, torch.cat((slots, pad)).to(DEV),
                              kv_scale)
    keep = torch.ones(N * S, dtype=torch.bool)
    keep[spare * S + 1] = False
    assert torch.equal(cache.cpu().view(-1, R + P)[keep].view(torch.uint8),
                       want.view(-1, R + P)[keep].view(torch.uint8))

    q = torch.randn(len(lens), H, R + P, generator=torch.Generator().manual_seed(10))
    live = [b for b, L in enumerate(lens) if L]
    out = mla_decode_triton(q.to(DEV), cache, tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV),
                            scale, R, num_splits=splits, kv_scale=kv_scale).cpu()
    nblk = -(-max(lens) // S)
    meta = AttentionMetadata(list(range(len(lens) + 1)), list(lens), tables, torch.empty(0), live, [],
                             decode_token_idx=torch.tensor(live), decode_seq_lens=torch.tensor([lens[b] for b in live]),
                             decode_block_tables=tables[live, :nblk].long())
    ref = torch.zeros(len(lens), H, R)
    mla_absorbed_torch(q, None, want, meta, [], True, scale, ref, kv_scale)
    explicit = torch.zeros(len(lens), H, R)  # the reference over a cache dequantised by hand
    mla_absorbed_torch(q, None, dequantize_kv(want, torch.float32, kv_scale), meta, [], True, scale, explicit)
    torch.testing.assert_close(ref, explicit, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (out[lens.index(0)] == 0).all()


def mla_layer_outputs(monkeypatch, cfg, cache_dtype, use_triton, steps, block_size=4, num_blocks=64, k_scale=0.25,
                      graph_layout=False):
    """The MLA layer's outputs over `steps` (new tokens, cached tokens per sequence) with a cache of
    cache_dtype, through its torch path or its Triton path (graph_layout: mixed steps as their CUDA
    graph runs them, every row absorbed, the chunks packed)."""
    torch.manual_seed(0)
    layer = MLAAttention(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    layer = layer.to(DEV)
    layer.k_scale = k_scale
    monkeypatch.setattr(mla_layer, "use_triton_path", lambda x: use_triton)
    layer.kv_cache = torch.zeros(layer.kv_cache_shape(num_blocks, block_size), dtype=cache_dtype, device=DEV)
    gen = torch.Generator().manual_seed(1)
    outs = []
    for new, cached in steps:
        x = torch.randn(sum(new), cfg.hidden_size, generator=gen).to(DEV)
        meta, positions = mla_step_metadata(new, cached, block_size, num_blocks, DEV)
        meta.host_lists = not (graph_layout and not meta.decode_only)
        with torch.no_grad():
            outs.append(layer(positions, x, meta).cpu())
    return outs


MLA_STEPS = [([5, 1, 9, 3], [0, 0, 0, 0]), ([1, 6, 1, 1], [5, 1, 9, 3]), ([1, 1, 1, 1], [6, 7, 10, 4])]


@needs_triton_device
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("graph_layout", [False, True])
def test_mla_layer_fp8_both_paths(monkeypatch, dtype, graph_layout):
    """The layer over an FP8 cache: the Triton path (latent write, varlen prefill over the
    dequantised context, absorbed decode; or, as a mixed step's graph, every row absorbed and the
    chunks packed) equals the torch path; both stay near the fp32-cache output but not on it."""
    rope = RopeConfig(10000.0, "yarn", 4.0, 16, {"mscale": 0.707, "mscale_all_dim": 1.0})
    cfg = MLAConfig(hidden_size=40, num_heads=3, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12,
                    qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=256, rope=rope)
    torch_path = mla_layer_outputs(monkeypatch, cfg, dtype, False, MLA_STEPS)
    triton_path = mla_layer_outputs(monkeypatch, cfg, dtype, True, MLA_STEPS, graph_layout=graph_layout)
    exact = mla_layer_outputs(monkeypatch, cfg, torch.float32, False, MLA_STEPS)
    for step, (a, b, c) in enumerate(zip(triton_path, torch_path, exact)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        err = ((b - c).norm() / c.norm()).item()
        assert 1e-4 < err < 0.2, f"step {step}: FP8 cache vs fp32 cache rel err {err}"


# --- GPU: real shapes, bf16, CUDA graphs ----------------------------------------------------------

def real_batch(seqs, H, G, d, S, dtype, seed):
    batch = paged_batch(seqs, S, H=H, G=G, d=d, seed=seed, stale_cache=True)
    batch = dataclasses.replace(batch, q=batch.q.to(torch.bfloat16).float())
    return batch, quantize_cache(batch.cache, dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", FP8)
def test_gpu_qwen3_shapes_bf16(dtype):
    """Qwen3-30B-A3B attention (32 query / 4 KV heads, d 128), bf16 queries over an FP8 cache: the
    decode, unified and prefill kernels against the reference (fp32 on the CPU)."""
    H, G, d, S = 32, 4, 128, 16
    decodes = [(c, 1) for c in (0, 15, 16, 1000, 4095, 300)]
    batch, cache8 = real_batch(decodes, H, G, d, S, dtype, seed=11)
    tables, qsl, lens = device_layout(batch)
    q = batch.q.to(DEV, torch.bfloat16)
    ref = reference(batch, cache8)
    for splits in (None, 1, 8):
        out = paged_attention_decode_triton(q, cache8.to(DEV), tables, lens, batch.scale, num_splits=splits,
                                            k_scale=K_SCALE, v_scale=V_SCALE)
        torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    mixed = [(0, 700), (300, 1), (1000, 65), (2047, 1)]
    batch, cache8 = real_batch(mixed, H, G, d, S, dtype, seed=12)
    tables, qsl, lens = device_layout(batch)
    q = batch.q.to(DEV, torch.bfloat16)
    ref = reference(batch, cache8)
    out = unified_attention_triton(q, cache8.to(DEV), tables, qsl, lens, batch.scale, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    out = paged_attention_prefill_triton(q, cache8.to(DEV), tables, qsl, lens, 700, batch.scale,
                                         k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("dtype", FP8)
def test_gpu_mla_decode_deepseek_shapes(dtype):
    lens, S, H, R, P = [1, 16, 17, 300, 1000, 4096, 0, 2049], 16, 128, 512, 64
    rows, slots, tables, N = latent_inputs(lens, S, R + P, seed=13)
    cache = torch.zeros(N, S, R + P, dtype=dtype)
    write_latent_cache(rows, cache, slots, 0.3)
    q = torch.randn(len(lens), H, R + P, generator=torch.Generator().manual_seed(0)).bfloat16()
    live = [b for b, L in enumerate(lens) if L]
    meta = AttentionMetadata(list(range(len(lens) + 1)), list(lens), tables, torch.empty(0), live, [],
                             decode_token_idx=torch.tensor(live), decode_seq_lens=torch.tensor([lens[b] for b in live]),
                             decode_block_tables=tables[live].long())
    ref = torch.zeros(len(lens), H, R)
    mla_absorbed_torch(q.float(), None, cache, meta, [], True, 192 ** -0.5, ref, 0.3)
    for splits in (None, 1, 7):
        out = mla_decode_triton(q.to(DEV), cache.to(DEV), tables.to(DEV), torch.tensor(lens, device=DEV), 192 ** -0.5,
                                R, num_splits=splits, kv_scale=0.3)
        torch.testing.assert_close(out.float().cpu(), ref, atol=3e-2, rtol=3e-2)


@needs_cuda
def test_gpu_fp8_decode_replays_in_cuda_graph():
    """The FP8 decode (write, then attention) captured once replays for new lengths and queries."""
    H, G, d, S, B, M = 32, 4, 128, 16, 4, 64
    batch, cache8 = real_batch([(c, 1) for c in (5, 1000, 17, 511)], H, G, d, S, torch.float8_e4m3fn, seed=14)
    tables, _, lens = device_layout(batch)
    tables = torch.cat((tables, torch.zeros(B, M - tables.shape[1], dtype=tables.dtype, device=DEV)), 1)
    cache = cache8.to(DEV)
    q = batch.q.to(DEV, torch.bfloat16)
    k_new, v_new = (t.to(DEV, torch.bfloat16) for t in (batch.k_new, batch.v_new))
    slots = batch.meta.slot_mapping_T.to(DEV)
    out = torch.empty_like(q)

    def step():
        write_kv_cache_triton(k_new, v_new, cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
        paged_attention_decode_triton(q, cache, tables, lens, batch.scale, out_BHd=out, num_splits=4,
                                      k_scale=K_SCALE, v_scale=V_SCALE)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(15)).to(DEV, torch.bfloat16))
    lens.sub_(torch.tensor([0, 500, 0, 11], dtype=lens.dtype, device=DEV))  # shorter contexts this time
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    meta = dataclasses.replace(batch.meta, seq_lens=lens.tolist(), decode_seq_lens=lens.cpu().long())
    ref = paged_attention_torch(q.float().cpu(), batch.k_new, batch.v_new, cache.cpu(), meta, batch.scale,
                                k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)

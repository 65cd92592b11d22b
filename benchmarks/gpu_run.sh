#!/usr/bin/env bash
# One device call that checks and times what the CPU cannot: run from the repo root on the GPU
# machine, with the stages wanted, in order; logs and results go to $OUT (default ./gpu_out).
#
#   bash benchmarks/gpu_run.sh fp8 kernel-tests deepspeed tune bench-short
#   bash benchmarks/gpu_run.sh parallel-fp8 bench-full          # parallel-fp8 needs 2 GPUs
#
# On a GPU under 100 GB the Qwen3 shape's engine runs take 24 layers (BENCH_QWEN3_LAYERS=24) unless it is set.
#
# Stages:
#   fp8           CUDA tests of FP8 expert serving (seam + DeepSeek-V3 FP8 checkpoint)
#   kernel-tests  every test of the Triton kernel and of the deepspeed backend on the GPU
#                 (8 pytest-xdist workers: each test compiles its own kernels)
#   deepspeed     benchmarks/deepspeed_probe.py (loads .dsk/libdeepspeedft.so.xz if carried)
#   tune          `moe tune-moe --wide` on the short decode rows -> $OUT/configs
#   tune-mixed    `moe tune-moe --wide` on the Qwen3 shape's mixed- and prefill-step buckets (TUNE_M, default 768-4096;
#                 TUNE_BUDGET_S) -> $OUT/configs, then gpu_engine_bench.py qwen3 --runs mixed mixed_step with the shipped
#                 configs and with $OUT/configs -> $OUT/tune_mixed.json, $OUT/engine_{shipped,tuned}.json
#   bench-short   the kernel bench on the rows that fall short, with $OUT/configs if present
#   bench-full    the whole kernel bench (moe bench kernel; vLLM beside ours if benchmarks/vllm_kernel/ is carried) -> $OUT/kernel.json
#   gpu-tests     the CUDA tests of the attention, MLA, fused small kernels and vLLM-kernel adapter
#   bench-attn    benchmarks/bench_attention.py (ATTN_ARGS adds flags, e.g. "--mixed-only --sweep") -> $OUT/attention.json
#   unified-tiles the unified attention kernel's key tile / warps / stages: bench_attention.py --mixed-only --sweep
#                 --chunk-rows (the chunk alone, 512 and 2048 tokens over 1000 cached, and the target mixed step), then,
#                 when a config beats the shipped one by 4% on both chunk rows (pick_unified_tile), gpu_engine_bench.py
#                 qwen3 --runs mixed_step mixed shipped / MOE_UNIFIED_TILE=that one, alternating, TILE_ROUNDS (4) processes
#                 -> $OUT/attention_chunk_sweep.json, $OUT/unified_tile.txt, $OUT/tiles_ab/
#   ds-flash      benchmarks/deepspeed_flash_probe.py: DeepSpeed-FastGen's blocked flash attention beside the
#                 Triton kernels (carry .dsk/libblockedflash.so.xz) -> $OUT/deepspeed_flash.json
#   ab            A/B of environment switches: AB_VAR=1 / 0 / 1 / 0 (a fresh process each; AB_VAR=A,B sets
#                 both, AB_ROUNDS=2 stops after one on / off pair) over
#                 gpu_engine_bench.py ${AB_STAGE:-qwen3} --runs $AB_RUNS (default tpot1) -> $OUT/ab/
#                 (AB_STAGE=qwen3-tp2: the same runs under tensor_parallel_size=2, two GPUs)
#   bench-fused   benchmarks/bench_fused.py -> $OUT/fused.json
#   kernel-vllm   the expert layer against vLLM's kernel on a few rows of each shape, same run
#                 (needs benchmarks/vllm_kernel/ carried: benchmarks/fetch_vllm_kernel.py) -> $OUT/kernel_vllm.json
#   engine        benchmarks/gpu_engine_bench.py $ENGINE (default: parity qwen3 eager families)
#                 -> $OUT/engine.json; RUNS= picks the qwen3 runs (tp2 needs two GPUs)
#   mixed         gpu_engine_bench.py qwen3 --runs mixed: real traffic offline on the Qwen3-30B-A3B shape,
#                 400 prompts of 512 +-75% tokens generating 128 +-75% in one LLM.generate; wall time,
#                 output tok/s, fraction of the floor, and per kind of step (decode / mixed / prefill) the
#                 count, seconds, ms and tokens per step, and how many ran eagerly -> $OUT/engine_mixed.json (~1 min)
#   a2a-ll        moe bench all2all on 2 GPUs with the low_latency dispatcher and auto beside the others and the
#                 bare collective, eager and replayed from CUDA graphs (DeepSeek-V3 shapes, 128-16384 tokens per
#                 rank) -> $OUT/a2a_low_latency.json
#   ep-graphs     DP=2 + EP with the low_latency dispatcher and CUDA graphs vs one GPU (needs 2 GPUs),
#                 and the dispatch kernels' GPU tests
#   parallel-fp8  an FP8 DeepSeek-V3 tiny checkpoint under TP2 and TP2+EP2 vs one GPU and its
#                 dequantised twin (.gpu_ckpts/deepseek_v3_fp8[_twin])
#   serve         benchmarks/serve_gpu_bench.py: offline vs `moe serve` (1 and 4 API processes) on the
#                 Qwen3-30B-A3B shape (SERVE_CKPT, default .gpu_ckpts/qwen3_30b_a3b; SERVE_ARGS adds flags,
#                 e.g. "--num-prompts 500") -> $OUT/serve/summary.json
#   serve-poisson serve_gpu_bench.py --request-rates 4,8,16,inf: one `moe serve` (1 API process) on the
#                 Qwen3-30B-A3B shape (SERVE_CKPT as above; the default's config.json is written when missing)
#                 driven by `moe bench serve` at each rate in turn (Poisson arrivals), 400 text prompts of
#                 512 +-75% tokens, 128 +-75% out; TTFT / TPOT / ITL / E2E mean, p50, p90, p99 per rate
#                 (POISSON_ARGS adds flags, e.g. "--api-server-counts 4"; POISSON_TAG suffixes the folder)
#                 -> $OUT/serve_poisson$POISSON_TAG/summary.json
#                 (~4-5 min: 100 + 50 + 25 s of arrivals, the inf run, start-up and warm-up; bound 8 min)
#   mm-fixtures   HF's Llama-4 processor (needs torchvision) on the test images -> $OUT/fixtures (installs the
#                 carried .whl-hf wheels into /tmp/site-hf when transformers < 5.23 is missing)
#   mm-tests      the image tests on the GPU (tokens equal the CPU path's, with and without CUDA graphs)
#   vision        benchmarks/vision_encoder_gpu_bench.py: Scout's vision tower, 8-64 images, one GPU, and with
#                 two GPUs mm_encoder_tp_mode weights vs data under TP=2 -> $OUT/vision_tp1.json, vision_tp2.json
#   mm-cache      benchmarks/mm_processor_cache_bench.py on this host's CPUs -> $OUT/mm_processor_cache.json
#   two-gpu       what needs two GPUs, in one call: ep-graphs, a2a-ll, vision (TP=2 pair), and the engine's
#                 dp2ep stage (DP=2 + EP decode steps, low_latency with and without CUDA graphs, all_to_all,
#                 against TP=2) -> $OUT/engine_dp2ep.json
#   kv-fp8        the CUDA tests of the FP8 KV cache and of prompt logprobs, then benchmarks/bench_kv_fp8.py
#                 (blocks, kernel times, greedy agreement) -> $OUT/kv_fp8.json
#   engine-fp8    gpu_engine_bench.py qwen3 --runs ${FP8_RUNS:-decode256 tpot1 mixed} with a bf16 KV cache,
#                 then with kv_cache_dtype=fp8 -> $OUT/engine_kv_{auto,fp8}.json
#   structured    (carry .whl: extra_wheels below) the structured-output GPU tests, bench_grammar_mask.py on
#                 this host's CPUs, and gpu_engine_bench.py structured: TPOT under JSON-schema masks at 1 / 32 / 256
#                 requests against plain ones -> $OUT/grammar_mask_host.json, $OUT/engine_structured.json
#   gpt-oss-tests the sink / sliding-window attention and expert-bias / clamped-SwiGLU kernel tests on CUDA (with
#                 the attention and expert kernels' own), then gpu_engine_bench.py parity on the tiny gpt-oss
#                 checkpoints (dense and MXFP4; make_gpu_checkpoints.py --new) -> $OUT/engine_parity_gpt_oss.json
#   gpt-oss       gpu_engine_bench.py new-families: the gpt-oss-20b shape (bf16 experts) and GLM-4.5-Air's cut to 8
#                 layers (dummy weights), decode steps at 64 / 256 and offline 256 x 1024 -> 128 against their
#                 floors (RUNS to choose) -> $OUT/engine_gpt_oss.json
#   mxfp4         the MXFP4 expert-kernel tests on CUDA, then benchmarks/bench_mxfp4_experts.py: the gpt-oss-20b and
#                 -120b expert layers with MXFP4 weights against bf16 ones of the same values -> $OUT/mxfp4_experts.json
#   split-gate-up benchmarks/bench_split_gate_up.py: the expert layer at 1-32 tokens with the configs in use and with
#                 gate_up's D range split 2 / 4 / 8 (and down's F range 2 / 4), Qwen3 bf16 and gpt-oss MXFP4 shapes
#                 (SPLIT_ARGS adds flags) -> $OUT/split_gate_up.json
#   mxfp4-tune    the MXFP4 expert-kernel tests under MXFP4_TUNE_ENV (e.g. MOE_MXFP4_DOT_SCALED=1: tl.dot_scaled),
#                 bench_mxfp4_experts.py (both forms beside bf16), then `moe tune-moe --dtype mxfp4` at the gpt-oss-20b
#                 and -120b shapes under MXFP4_TUNE_ENV -> $OUT/mxfp4_experts.json, $OUT/configs, $OUT/tune_mxfp4_E*.json
#   hybrid        (carry .gpu_ckpts from make_gpu_checkpoints.py --hybrid, and .whl with fla-core + einops for
#                 the field's kernel beside ours) HYBRID_PARTS (default "tests parity kernel engine"): the Gated
#                 DeltaNet kernel tests on CUDA; greedy tokens of the tiny Qwen3-Next / Qwen3.5-MoE checkpoints on
#                 the GPU against the CPU's, in 64-token chunks and whole (the 150-token prompt in one step: the
#                 chunked kernel); bench_gated_delta.py; gpu_engine_bench.py hybrid (the Qwen3-Next-80B-A3B shape
#                 cut to HYBRID_LAYERS, default 24; 12 fits an H100), RUNS to choose, then once more per entry of
#                 HYBRID_AB ("recurrent": MOE_GATED_DELTA_PREFILL=recurrent; "fla": MOE_FLA_PREFILL=1; "chunked":
#                 the default again) -> $OUT/gated_delta.json, $OUT/engine_parity_hybrid{,_512}.json,
#                 $OUT/engine_hybrid.json, $OUT/engine_hybrid_<i>_<ab>.json
#   routed-experts  the CUDA-graph test of returned routed experts, then gpu_engine_bench.py qwen3 --runs $AB_RUNS
#                 (default decode256 mixed) with enable_return_routed_experts on / off / on / off, a fresh process
#                 each -> $OUT/ab/{1..4}_routed_{1,0}.json
#   batch-invariant  the batch-invariant mode's CUDA tests (kernels, tiny checkpoints under CUDA graphs), then
#                 benchmarks/batch_invariance_gpu.py (the Qwen3-30B-A3B shape: one prompt among 0 / 63 / 255 others,
#                 chunked, prefix-cached; the mode on and off) -> $OUT/invariance.json
#   invariant-cost  the batch-invariant mode's cost:
#                 gpu_engine_bench.py qwen3 --runs $AB_RUNS (default decode256 mixed) with MOE_BATCH_INVARIANT
#                 on / off / on / off, a fresh process each -> $OUT/ab/{1..4}_invariant_{1,0}.json
#   expert-tiles  benchmarks/bench_expert_tiles.py (the Qwen3-30B-A3B expert layer at mixed-step sizes over a grid of
#                 tiles, each with and without HALF_TILES, against the shipped configs; the winners into $OUT/configs),
#                 then gpu_engine_bench.py qwen3 --runs ${TILES_RUNS:-mixed mixed_step} with the coarser mixed-graph sizes
#                 (MOE_FINE_MIXED_SIZES=0), with the shipped configs and with $OUT/configs (TILES_M: the bench's --M;
#                 TILES_ARGS adds flags, e.g. "--no-grid": the shipped configs, bmm and their kernels only; "--down-tma":
#                 the down GEMM's tiles with and without TMA in place of the grid)
#                 -> $OUT/expert_tiles.json, $OUT/engine_{coarse,shipped,tiles}.json
#   mla-mixed     MLA's mixed steps from CUDA graphs, MLA_PARTS (default "tests bench engine"): the MLA kernel and layer
#                 tests, the MLA mixed-graph and eager warm-up engine tests on CUDA; benchmarks/bench_mla_mixed.py (one
#                 layer's attention of a mixed step, every row absorbed against the prefill rows expanded); then
#                 gpu_engine_bench.py mla-mixed (Moonlight-16B-A3B's shape, the DeepSeek-V3 cut of MLA_DEEPSEEK_LAYERS,
#                 default 4, 3 for an H100; MLA_ONLY: the shapes whose names start so; MLA_RUNS, default mixed_step
#                 mixed decode256) with MOE_MLA_ABSORBED_TOKENS=0
#                 (mixed steps eager, the expanded prefill rows) and with the default (graphs)
#                 -> $OUT/mla_mixed.json, $OUT/engine_mla_{eager,graphs}.json
#   ncu           Nsight Compute over a Qwen3 mixed step's heaviest kernels (benchmarks/ncu_mixed_step.py): the expert
#                 GEMMs at 768 and 2048 tokens beside cuBLAS bmm, and the attention of 255 decodes + a 512-token chunk
#                 (DRAM throughput, occupancy, warp stalls; needs a machine whose ncu reads the counters)
#                 -> $OUT/ncu_{768,2048,attention}.log
#   eplb          (two GPUs) benchmarks/eplb_gpu_bench.py: DP2+EP on the Qwen3-30B-A3B shape, a skewed workload,
#                 balancedness and decode-step time before/after one EPLB rebalance (EPLB_ARGS adds flags) -> $OUT/eplb.json
set -u
export OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG="$OUT/run.log"
step() { echo "=== $1 ($(date +%T))" | tee -a "$LOG"; shift; "$@" 2>&1 | tee -a "$LOG" | tail -40; }
[ -f .dsk/libdeepspeedft.so.xz ] && [ ! -f /tmp/libdeepspeedft.so ] && \
    xz -dc .dsk/libdeepspeedft.so.xz > /tmp/libdeepspeedft.so
[ -f /tmp/libdeepspeedft.so ] && export MOE_DEEPSPEED_FT_LIB=/tmp/libdeepspeedft.so
CFG="$OUT/configs"
# The Qwen3 shape's engine runs on a GPU under 100 GB: 24 layers (gpu_engine_bench.py's BENCH_QWEN3_LAYERS), whose
# KV cache holds 256 running requests as an H200's holds the 48 layers' (48 on 80 GB: preemptions); an H200: 48.
if [ -z "${BENCH_QWEN3_LAYERS:-}" ] && python3 -c "import sys, torch
sys.exit(not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory > 100e9)" 2>/dev/null; then
  export BENCH_QWEN3_LAYERS=24; echo "BENCH_QWEN3_LAYERS=24 (a GPU under 100 GB)" | tee -a "$LOG"
fi
# PYTHONPATH with transformers >= 5.23 (Llama-4 multimodal): the carried .whl-hf wheels when the
# machine's own is older or missing.
hf_path() {
  if python3 -c "import transformers as t; assert tuple(map(int, t.__version__.split('.')[:2])) >= (5, 23)" \
      2>/dev/null; then echo "$PYTHONPATH"; return; fi
  [ -d /tmp/site-hf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site-hf .whl-hf/*.whl >&2
  echo ".:/tmp/site-hf${PYTHONPATH:+:$PYTHONPATH}"
}
# The runtime's packages the GPU machine lacks (llguidance, xgrammar and its apache-tvm-ffi, the server's, with
# fastapi's own: opentelemetry-api and annotated-doc from fastapi 0.165): carry .whl with their cp312 wheels
# (pip download --only-binary=:all: --python-version 3.12 --no-deps ...); installed once into /tmp/site-extra,
# after the machine's own packages on PYTHONPATH.
EXTRA_IMPORTS="import llguidance, xgrammar, fastapi, uvicorn, zmq, msgpack, httpx, prometheus_client, plotly, fla"
extra_wheels() {
  export PYTHONPATH="$PYTHONPATH:/tmp/site-extra"
  python3 -c "$EXTRA_IMPORTS" 2>/dev/null && return
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site-extra .whl/*.whl
  python3 -c "$EXTRA_IMPORTS" || echo "extra_wheels: still missing (see above)" | tee -a "$LOG"
}
for stage in "$@"; do
  case $stage in
    fp8) step fp8 timeout 150 python3 -m pytest -q -p no:cacheprovider \
           tests/kernels/test_fused_experts_seam.py tests/models/test_deepseek_v3_fp8.py ;;
    kernel-tests) step kernel-tests timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 \
           tests/kernels/test_triton_moe.py tests/kernels/test_deepspeed_backend.py ;;
    deepspeed)  # the library aborts its process on a C++ error: benches use it once it worked
      echo "=== deepspeed ($(date +%T))" | tee -a "$LOG"
      timeout 120 python3 benchmarks/deepspeed_probe.py > /tmp/ds.log 2>&1 && touch /tmp/deepspeed_ok
      tee -a "$LOG" < /tmp/ds.log | tail -40 ;;
    tune)
      mkdir -p "$CFG"
      step tune-qwen3 timeout 170 python3 -m kernels.triton_moe.tune --E 128 --D 2048 --F 768 \
           --topk 8 --M 8 64 --wide --budget-s 130 --out-dir "$CFG"
      step tune-llama4 timeout 80 python3 -m kernels.triton_moe.tune --E 16 --D 5120 --F 8192 \
           --topk 1 --M 1 --wide --budget-s 50 --out-dir "$CFG" ;;
    tune-mixed) mkdir -p "$CFG"
      step tune-mixed timeout 280 python3 -m kernels.triton_moe.tune --E 128 --D 2048 --F 768 --topk 8 --wide \
           --M ${TUNE_M:-768 1024 1536 2048 3072 4096} --budget-s ${TUNE_BUDGET_S:-220} --out-dir "$CFG" \
           --report "$OUT/tune_mixed.json"
      step engine-shipped timeout 150 python3 benchmarks/gpu_engine_bench.py qwen3 --runs mixed mixed_step \
           --out "$OUT/engine_shipped.json"
      step engine-tuned env MOE_KERNEL_CONFIG_DIR="$CFG" timeout 150 python3 benchmarks/gpu_engine_bench.py qwen3 \
           --runs mixed mixed_step --out "$OUT/engine_tuned.json" ;;
    bench-short) [ -d "$CFG" ] && export MOE_KERNEL_CONFIG_DIR="$CFG"
      step bench-short timeout 200 python3 -m moe.bench.kernel --no-ceilings --profile \
           --no-baselines --no-deepspeed --fp8-shapes \
           --rows qwen3-30b-a3b:1,8,64,256,4096 llama4-scout:1 deepseek-v3:8,64,256 --out "$OUT/kernel_short.json" ;;
    bench-full) [ -d "$CFG" ] && export MOE_KERNEL_CONFIG_DIR="$CFG"
      DS=--no-deepspeed; [ -f /tmp/deepspeed_ok ] && DS=
      step bench-full timeout 560 python3 -m moe.bench.kernel $DS --profile --out "$OUT/kernel.json" ;;
    gpu-tests) step gpu-tests timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 \
           tests/kernels/test_triton_attention.py tests/kernels/test_triton_mla.py \
           tests/kernels/test_triton_fused.py tests/kernels/test_vllm_kernel_adapter.py tests/moe/test_cuda_graphs.py \
           tests/kernels/test_expert_count.py tests/moe/test_expert_load.py tests/kernels/test_triton_skinny.py tests/kernels/test_pdl.py ;;
    ab) mkdir -p "$OUT/ab"  # on / off / on / off, a fresh process each; AB_VAR may list several (A,B,C)
      for i in $(seq 1 ${AB_ROUNDS:-4}); do v=$(( i % 2 ))
        sets=$(echo "$AB_VAR" | tr ',' '\n' | sed "s/\$/=$v/" | tr '\n' ' ')
        step "ab $i $sets" env $sets timeout 290 python3 benchmarks/gpu_engine_bench.py ${AB_STAGE:-qwen3} \
             --runs ${AB_RUNS:-tpot1} --out "$OUT/ab/${i}_$(echo "$AB_VAR" | tr ',' '-')_$v.json"
      done ;;
    unified-tiles) mkdir -p "$OUT/tiles_ab"
      step unified-sweep timeout 300 python3 benchmarks/bench_attention.py --mixed-only --sweep --chunk-rows \
           --out "$OUT/attention_chunk_sweep.json"
      python3 -c "import json, sys; sys.path.insert(0, 'benchmarks'); from bench_attention import pick_unified_tile
print(pick_unified_tile(json.load(open(sys.argv[1]))['results']) or '')" "$OUT/attention_chunk_sweep.json" \
           > "$OUT/unified_tile.txt" || : > "$OUT/unified_tile.txt"
      tile=$(cat "$OUT/unified_tile.txt"); echo "unified tile: ${tile:-none (no sweep, or none beats the shipped one)}" | tee -a "$LOG"
      for i in $(seq 1 $([ -n "$tile" ] && echo "${TILE_ROUNDS:-4}" || echo 0)); do
        if (( i % 2 )); then sets=(); name=shipped; else sets=(MOE_UNIFIED_TILE="$tile"); name=${tile//,/-}; fi
        step "tiles $i $name" env "${sets[@]}" timeout 200 python3 \
             benchmarks/gpu_engine_bench.py qwen3 --runs mixed_step mixed --out "$OUT/tiles_ab/${i}_$name.json"
      done ;;
    ds-flash) step ds-flash timeout 560 python3 benchmarks/deepspeed_flash_probe.py --out "$OUT/deepspeed_flash.json" ;;
    bench-attn) step bench-attn timeout 300 python3 benchmarks/bench_attention.py ${ATTN_ARGS:-} --out "$OUT/attention.json" ;;
    bench-fused) step bench-fused timeout 150 python3 benchmarks/bench_fused.py --out "$OUT/fused.json" ;;
    kernel-vllm) step kernel-vllm timeout 240 python3 -m moe.bench.kernel --no-baselines --no-deepspeed \
           --no-ceilings --rows qwen3-30b-a3b:1,64,256,4096 deepseek-v3:8,256 llama4-scout:1,1024 \
           --out "$OUT/kernel_vllm.json" ;;
    engine) step engine timeout 580 python3 benchmarks/gpu_engine_bench.py ${ENGINE:-parity qwen3 eager families} \
           ${RUNS:+--runs $RUNS} --out "$OUT/engine.json" ;;
    a2a-ll) step a2a-ll timeout 300 torchrun --nproc-per-node=2 -m moe.bench.all2all \
           --backends allgather_reducescatter all_to_all low_latency auto --cuda-graphs --phases --out "$OUT/a2a_low_latency.json" ;;
    ep-graphs) step ep-graphs timeout 300 python3 -m pytest -q -p no:cacheprovider \
           tests/parallel/test_low_latency_graphs_gpu.py tests/kernels/test_triton_dispatch.py ;;
    parallel-fp8) step parallel-fp8 timeout 300 python3 benchmarks/gpu_parallel_check.py \
           .gpu_ckpts/deepseek_v3_fp8 --layouts tp2 tp2_ep2 --twin .gpu_ckpts/deepseek_v3_fp8_twin \
           --out "$OUT/parallel_fp8.json" ;;
    serve) extra_wheels; step serve timeout 590 python3 benchmarks/serve_gpu_bench.py ${SERVE_CKPT:-.gpu_ckpts/qwen3_30b_a3b} \
           --out-dir "$OUT/serve" --deadline-s 570 ${SERVE_ARGS:-} ;;
    mixed) step mixed timeout 300 python3 benchmarks/gpu_engine_bench.py qwen3 --runs ${MIXED_RUNS:-mixed} \
           --out "$OUT/engine_mixed.json" ;;
    serve-poisson) CKPT=${SERVE_CKPT:-.gpu_ckpts/qwen3_30b_a3b}; extra_wheels
      [ -n "${SERVE_CKPT:-}" ] || [ -f "$CKPT/config.json" ] || python3 -c "import json, os, sys
from moe.bench.common import QWEN3_30B_A3B
os.makedirs(sys.argv[1], exist_ok=True)
json.dump(QWEN3_30B_A3B, open(os.path.join(sys.argv[1], 'config.json'), 'w'))" "$CKPT"
      step serve-poisson timeout 480 python3 benchmarks/serve_gpu_bench.py "$CKPT" --out-dir "$OUT/serve_poisson${POISSON_TAG:-}" \
           --request-rates 4,8,16,inf --num-prompts 400 --input-len 512 --output-len 128 --random-range-ratio 0.75 \
           --deadline-s 465 ${POISSON_ARGS:-} ;;
    hybrid) extra_wheels
      parts=" ${HYBRID_PARTS:-tests parity kernel engine} "
      hybrid_engine=(python3 benchmarks/gpu_engine_bench.py hybrid --hybrid-layers "${HYBRID_LAYERS:-24}" ${RUNS:+--runs $RUNS})
      # (not tests/kernels/test_gated_delta.py: with fla installed, transformers sends its torch reference to fla,
      # which refuses that test's CPU tensors)
      [[ $parts == *" tests "* ]] && step hybrid-tests timeout 200 python3 -m pytest -q -p no:cacheprovider \
           tests/kernels/test_triton_gated_delta.py tests/kernels/test_triton_gated_delta_chunked.py \
           tests/kernels/test_fla_gated_delta.py
      if [[ $parts == *" parity "* ]]; then
        step hybrid-parity timeout 200 python3 benchmarks/gpu_engine_bench.py parity --checkpoints .gpu_ckpts/qwen3_next \
             .gpu_ckpts/qwen3_5_moe --out "$OUT/engine_parity_hybrid.json"
        step hybrid-parity-512 timeout 200 python3 benchmarks/gpu_engine_bench.py parity --parity-batched-tokens 512 \
             --checkpoints .gpu_ckpts/qwen3_next .gpu_ckpts/qwen3_5_moe --out "$OUT/engine_parity_hybrid_512.json"
      fi
      [[ $parts == *" kernel "* ]] && step gated-delta timeout 150 python3 benchmarks/bench_gated_delta.py \
           --out "$OUT/gated_delta.json"
      if [[ $parts == *" engine "* ]]; then
        step hybrid-engine timeout 300 "${hybrid_engine[@]}" --out "$OUT/engine_hybrid.json"
        i=0
        for ab in ${HYBRID_AB:-}; do i=$((i + 1))
          case $ab in
            recurrent) switch=(MOE_GATED_DELTA_PREFILL=recurrent) ;;
            fla) switch=(MOE_FLA_PREFILL=1) ;;
            *) switch=() ;;
          esac
          step "hybrid-engine $i $ab" env "${switch[@]}" timeout 300 "${hybrid_engine[@]}" \
               --out "$OUT/engine_hybrid_${i}_$ab.json"
        done
      fi ;;
    routed-experts)  # returned routed experts: the CUDA-graph test, then their cost on / off / on / off
      step routed-tests timeout 200 python3 -m pytest -q -p no:cacheprovider tests/moe/test_routed_experts.py -k cuda
      mkdir -p "$OUT/ab"
      for i in 1 2 3 4; do v=$(( i % 2 ))
        step "routed $i BENCH_ROUTED_EXPERTS=$v" env BENCH_ROUTED_EXPERTS=$v timeout 290 python3 \
             benchmarks/gpu_engine_bench.py qwen3 --runs ${AB_RUNS:-decode256 mixed} --out "$OUT/ab/${i}_routed_$v.json"
      done ;;
    batch-invariant)
      step invariant-tests env PYTHONPATH="$(hf_path)" timeout 300 python3 -m pytest -q -p no:cacheprovider \
           tests/kernels/test_batch_invariant_kernels.py tests/moe/test_batch_invariant.py
      step invariance timeout 300 python3 benchmarks/batch_invariance_gpu.py --out "$OUT/invariance.json" ;;
    invariant-cost) mkdir -p "$OUT/ab"
      for i in 1 2 3 4; do v=$(( i % 2 ))
        step "invariant $i MOE_BATCH_INVARIANT=$v" env MOE_BATCH_INVARIANT=$v timeout 290 python3 \
             benchmarks/gpu_engine_bench.py qwen3 --runs ${AB_RUNS:-decode256 mixed} --out "$OUT/ab/${i}_invariant_$v.json"
      done ;;
    mm-fixtures) mkdir -p "$OUT/fixtures"
      step mm-fixtures env PYTHONPATH="$(hf_path)" timeout 200 \
        python3 tests/fixtures/llama4_processor/make_fixtures.py "$OUT/fixtures" ;;
    mm-tests) step mm-tests env PYTHONPATH="$(hf_path)" timeout 300 python3 -m pytest -q -p no:cacheprovider \
           tests/models/test_llama4_mm_engine.py -k "gpu or one_image or chunks" ;;
    vision)
      step vision-tp1 timeout 240 python3 benchmarks/vision_encoder_gpu_bench.py --output-json "$OUT/vision_tp1.json"
      [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && step vision-tp2 timeout 300 torchrun --nproc-per-node 2 \
           benchmarks/vision_encoder_gpu_bench.py --output-json "$OUT/vision_tp2.json" ;;
    two-gpu) bash "$0" ep-graphs a2a-ll vision
      step dp2ep timeout 590 python3 benchmarks/gpu_engine_bench.py dp2ep --out "$OUT/engine_dp2ep.json" ;;
    mm-cache) step mm-cache timeout 200 python3 benchmarks/mm_processor_cache_bench.py --out "$OUT/mm_processor_cache.json" ;;
    kv-fp8) step kv-fp8-tests timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 \
           tests/kernels/test_fp8_kv_cache.py tests/kernels/test_fp8_kv_runner_path.py tests/moe/test_kv_cache_fp8.py \
           tests/models/test_kv_cache_scales.py tests/moe/test_prompt_logprobs.py
      step kv-fp8-bench timeout 300 python3 benchmarks/bench_kv_fp8.py --out "$OUT/kv_fp8.json" ;;
    mla-mixed) parts=" ${MLA_PARTS:-tests bench engine} "
      [[ $parts == *" tests "* ]] && step mla-tests timeout 300 python3 -m pytest -q -p no:cacheprovider \
           tests/kernels/test_triton_mla.py tests/moe/test_eager_warm_up.py tests/moe/test_cuda_graphs.py
      [[ $parts == *" bench "* ]] && step mla-bench timeout 200 python3 benchmarks/bench_mla_mixed.py \
           --out "$OUT/mla_mixed.json"
      if [[ $parts == *" engine "* ]]; then
        for side in eager graphs; do
          step "mla-mixed $side" env MOE_MLA_ABSORBED_TOKENS=$([ $side = eager ] && echo 0 || echo 2048) timeout 400 \
               python3 benchmarks/gpu_engine_bench.py mla-mixed --deepseek-layers "${MLA_DEEPSEEK_LAYERS:-4}" \
               --runs ${MLA_RUNS:-mixed_step mixed decode256} ${MLA_ONLY:+--only $MLA_ONLY} --out "$OUT/engine_mla_$side.json"
        done
      fi ;;
    engine-fp8) for dt in auto fp8; do
        step "engine kv $dt" env BENCH_KV_CACHE_DTYPE=$dt timeout 290 python3 benchmarks/gpu_engine_bench.py qwen3 \
             --runs ${FP8_RUNS:-decode256 tpot1 mixed} --out "$OUT/engine_kv_$dt.json"
      done ;;
    structured) extra_wheels
      python3 -c "import transformers, importlib.metadata as m; print('transformers', transformers.__version__, \
          'xgrammar', m.version('xgrammar'), 'llguidance', m.version('llguidance'))" 2>&1 | tail -1 | tee -a "$LOG"
      step structured-tests timeout 200 python3 -m pytest -q -p no:cacheprovider \
           tests/structured_output/test_gpu.py tests/kernels/test_token_bitmask.py tests/structured_output/test_backends.py
      step grammar-mask timeout 200 python3 benchmarks/bench_grammar_mask.py --out "$OUT/grammar_mask_host.json"
      step structured-engine timeout 400 python3 benchmarks/gpu_engine_bench.py structured --out "$OUT/engine_structured.json" ;;
    gpt-oss-tests) step gpt-oss-kernels timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 \
           tests/kernels/test_attention_sinks_window.py tests/kernels/test_expert_bias_swiglu.py \
           tests/kernels/test_triton_attention.py tests/kernels/test_unified_attention.py tests/kernels/test_triton_moe.py
      step gpt-oss-parity timeout 280 python3 benchmarks/gpu_engine_bench.py parity --checkpoints .gpu_ckpts/gpt_oss \
           .gpu_ckpts/gpt_oss_mxfp4 --out "$OUT/engine_parity_gpt_oss.json" ;;
    gpt-oss) step gpt-oss timeout 580 python3 benchmarks/gpu_engine_bench.py new-families ${RUNS:+--runs $RUNS} \
           --out "$OUT/engine_gpt_oss.json" ;;
    mxfp4) step mxfp4-tests timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mxfp4_experts.py
      step mxfp4-bench timeout 280 python3 benchmarks/bench_mxfp4_experts.py --out "$OUT/mxfp4_experts.json" ;;
    split-gate-up) step split-gate-up timeout 300 python3 benchmarks/bench_split_gate_up.py --M 1 2 4 8 16 32 \
           --out "$OUT/split_gate_up.json" ${SPLIT_ARGS:-} ;;
    mxfp4-tune) mkdir -p "$CFG"  # MXFP4_TUNE_ENV (e.g. MOE_MXFP4_DOT_SCALED=1) sets the kernels' form
      step mxfp4-tests-env env ${MXFP4_TUNE_ENV:-} timeout 200 python3 -m pytest -q -p no:cacheprovider \
           tests/kernels/test_mxfp4_experts.py
      step mxfp4-bench timeout 280 python3 benchmarks/bench_mxfp4_experts.py --out "$OUT/mxfp4_experts.json"
      for E in 32 128; do
        step "mxfp4-tune E=$E" env ${MXFP4_TUNE_ENV:-} timeout 150 python3 -m kernels.triton_moe.tune --E $E \
             --D 2880 --F 2880 --topk 4 --dtype mxfp4 --M ${MXFP4_TUNE_M:-1 8 64 256 1024 4096} \
             --budget-s ${MXFP4_TUNE_S:-110} --out-dir "$CFG" --report "$OUT/tune_mxfp4_E$E.json"
      done ;;
    expert-tiles) mkdir -p "$CFG"
      # A GPU without tuned configs of the Qwen3 shape takes the H200's as the shipped ones.
      SHIPPED=(); dev=$(python3 -c "from kernels.triton_moe.config import device_name; print(device_name())")
      if [ ! -f "kernels/configs/E=128,N=768,device_name=$dev,dtype=bf16.json" ]; then
        mkdir -p /tmp/shipped_cfg; SHIPPED=(MOE_KERNEL_CONFIG_DIR=/tmp/shipped_cfg)
        cp "kernels/configs/E=128,N=768,device_name=NVIDIA_H200,dtype=bf16.json" \
           "/tmp/shipped_cfg/E=128,N=768,device_name=$dev,dtype=bf16.json"
      fi
      step expert-tiles env "${SHIPPED[@]}" timeout 360 python3 benchmarks/bench_expert_tiles.py \
           --out "$OUT/expert_tiles.json" --write-configs "$CFG" ${TILES_M:+--M $TILES_M} ${TILES_ARGS:-}
      step engine-coarse env "${SHIPPED[@]}" MOE_FINE_MIXED_SIZES=0 timeout 200 python3 benchmarks/gpu_engine_bench.py \
           qwen3 --runs ${TILES_RUNS:-mixed mixed_step} --out "$OUT/engine_coarse.json"
      step engine-shipped env "${SHIPPED[@]}" timeout 200 python3 benchmarks/gpu_engine_bench.py qwen3 \
           --runs ${TILES_RUNS:-mixed mixed_step} --out "$OUT/engine_shipped.json"
      step engine-tiles env MOE_KERNEL_CONFIG_DIR="$CFG" timeout 200 python3 benchmarks/gpu_engine_bench.py qwen3 \
           --runs ${TILES_RUNS:-mixed mixed_step} --out "$OUT/engine_tiles.json" ;;
    ncu) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats
                --section LaunchStats)
      for M in 768 2048; do
        step ncu-experts-$M timeout 150 "$NCU" --clock-control none --kernel-name regex:"gate_up_kernel|down_kernel|nvjet" \
             --launch-skip 4 --launch-count 4 "${SECTIONS[@]}" --log-file "$OUT/ncu_$M.log" \
             python3 benchmarks/ncu_mixed_step.py experts $M
      done
      step ncu-attention timeout 150 "$NCU" --clock-control none --kernel-name regex:"unified|decode" --launch-skip 4 \
           --launch-count 4 "${SECTIONS[@]}" --log-file "$OUT/ncu_attention.log" python3 benchmarks/ncu_mixed_step.py attention ;;
    eplb) step eplb timeout 580 python3 benchmarks/eplb_gpu_bench.py --out "$OUT/eplb.json" ${EPLB_ARGS:-} ;;
    *) echo "unknown stage $stage" | tee -a "$LOG" ;;
  esac
done

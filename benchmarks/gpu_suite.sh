#!/usr/bin/env bash
# GPU tests, then benchmarks, in one run from the repository root; parts run in the order given:
#   bash benchmarks/gpu_suite.sh tests kernels startup latency batch throughput features kvcache weights
# (`tests` = kernel and engine GPU tests; `engine-tests` = engine only (`engine-tests-1/2`: its first half),
#  `kernel-tests` = kernels only;
#  `serve-qwen3-0.6b`, `serve-llama3-8b` = the server against the engine, benchmarks/suite/serve_vs_engine.py;
#  `throughput-whole-peer` = Qwen3-0.6B's standard workload, transformers given all of it;
#  `latency-<shape>[,<shape>]` = batch-1 decode of those shapes at three context lengths, no peer;
#  `models-<shape>[,<shape>]` = `tokenmill bench models` on those shapes, e.g. models-gemma3-4b;
#  `spec-rewrite` = speculative decoding on the rewrite workload, benchmarks/suite/spec_decode_rewrite.py;
#  `spec` = the verify step against decode per batch size, and the standard workload with it on/off;
#  `sampling` = drawing a token per row (race and sort) and sampled workloads, benchmarks/suite/sampling_bench.py;
#  `sampling-profile` = the GPU kernels a sampled decode step adds, benchmarks/profile/profile_sampling.py;
#  `study-sampling` = the sampling kernel's tiles against the row count, benchmarks/studies/study_sampling_tiles.py;
#  `structured` = structured outputs, benchmarks/suite/structured_outputs_bench.py;
#  `tp` = on two GPUs, the tensor-parallel GPU tests and benchmarks/suite/tp_bench.py (all-reduces, 8B decode);
#  `tp70b` = on two GPUs, Llama-3-70B split over both: batch sweep and standard workload;
#  `weights` = bf16, FP8 and Q8_0 projections by batch, prompt and workload (`weights-<shape>[,<shape>]`: those);
#  `study-fp8` = the FP8 kernels' tiles and the row count where FP8 tensor cores take over,
#   benchmarks/studies/study_fp8.py;
#  `kernel-profile-b<N>` = the decode step's kernels at batch N (`kernel-profile`: batch 1);
#  `kvcache-profile` = the decode step's kernels and idle gaps at B = 64 over 8k tokens, per KV cache dtype, with the
#   SM clock and power logged beside each run (`kvcache-profile-<dtype>-clocks.csv`);
#  `kvcache-long` = 1,024 requests of 2k prompt / 1k output tokens on Llama-3-8B per KV cache dtype, the whole GPU's
#   memory for each (`kvcache-long-auto,int8`: the dtypes named);
#  `kvcache-workload-profile` = the KV-bound workload's steps against their floors per KV cache dtype, the clocks
#   logged (`workload-profile-kv-bound-<dtype>-clocks.csv`), then the decode step's kernels at its mean batch;
#  `ttft-profile` = a lone 100-token prompt's time to first token, its kernels and host functions;
#  `audit-host-waits` = the engine's lines that make the host wait for the GPU, per request feature,
#   benchmarks/profile/audit_host_waits.py;
#  `study-attention-quantized-deep` = the one-byte decode tile against 8 warps and narrower tiles in deeper pipelines;
#  `study-attention-quantized-ragged` = the one-byte decode tile against 3 stages and 64 keys at 1-4 KV splits, on
#   batches of mixed lengths and of 32-256 short contexts;
#  `study-attention-quantized-occupancy` / `study-attention-occupancy-bf16` = decode tiles under a register cap that
#   lets an SM hold 3-4 programs, over one-byte and 16-bit caches, on batches of mixed lengths;
#  `study-warp-keys` = int8 decode attention with each warp owning its keys, against the tile whose keys the warps
#   share, benchmarks/studies/study_warp_keys.py;
#  `study-attention-short` = decode attention tiles and split counts at the static-decode and workload batches;
#  `study-attention-short-gemma` = the same at head dim 256 (Gemma-3-4B's 8 q / 4 KV heads, and groups of 2
#   and 8), with batches of mixed lengths besides;
#  `study-attention-ragged` = decode batches of mixed lengths in arrival order and longest first, the engine's tile;
#  `startup-profile` = cProfile over building a Llama-3-8B engine;
#  `study-attention-prefill` = Llama-3-8B's prefill attention, every tile (`study-attention-prefill-quantized`:
#   over int8 and fp8 caches);
#  `study-attention-prefill-pipelined-scales` = prompt tiles over int8 and fp8 caches with the scales copied
#   with the K/V tiles, against read a tile ahead;
#  `study-attention-prompt-splits` = lone prompts and chunks deep in long contexts at 1-16 KV splits;
#  `study-prompt-attention` = a new prompt's attention over its contiguous keys in wider tiles, against the
#   engine's paged tile and torch's SDPA, benchmarks/studies/study_prompt_attention.py;
#  `study-attention-splits` = Llama-3-8B's decode attention at 1-16 KV splits from 1 to 128 sequences
#   (`study-attention-splits-gemma`: head dim 256, groups of 2 and 8);
#  `study-gemv-rows` = the one-row GEMV's tiles with several tiles of rows a program;
#  `study-prefill-backends` = prompt attention, the paged Triton kernel against torch's FlashAttention-2 and cuDNN
#   kernels (with and without gathering the keys first), benchmarks/studies/study_prefill_backends.py;
#  `study-overlap` = a large decode step's projections beside its attention on two streams, against one after the
#   other (Llama-3-8B, 490 sequences over 2,500 tokens of int8 and bf16 KV), benchmarks/studies/study_overlap.py;
#  `study-argmax` = the greedy argmax kernel against torch by row count and vocabulary, benchmarks/studies/study_argmax.py;
#  `study-softcap` = Gemma's final-logit softcap, the kernel against three torch ops, benchmarks/studies/study_softcap.py;
#  `study-skinny` = the few-row matmul's tiles and K splits at 4-64 rows, dense and Q8_0, benchmarks/studies/study_skinny.py
#   (`study-skinny-large`: at 128-2048 rows, where it takes Q8_0 weights only, against cuBLAS;
#   `study-skinny-dense`: dense weights at 64-256 rows against cuBLAS, Llama-3-8B, Gemma-3-4B, Qwen3-0.6B);
#  `study-tunableop` = cuBLAS against PyTorch TunableOp's timed choice of GEMM, Llama-3-8B at 32-256 rows;
#  `study-l2-prefetch` = a decode step's projections in a row with the next weight's head prefetched into
#   the L2 from a second stream, against without, benchmarks/studies/study_l2_prefetch.py;
#  `study-attention-ncu` = Nsight Compute on the decode attention kernel at 64 x 8k over fp8, int8 and bf16
#   caches: the details page and the stall samples by instruction, benchmarks/profile/profile_attention_ncu.py;
#  `study-q8-a8` = Q8_0 projections on rows quantized to int8 (dp4a at one row, int8 tensor cores at more)
#   against the kernels in use, benchmarks/studies/study_q8_a8.py.)
# Results and logs go to $OUT (default benchmarks/results/out); benchmarks/results/README.md indexes the kept runs.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-benchmarks/results/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # parts that change directory write here too
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.txt"
# Kernel tests are bound by Triton compiling on the host: spread them over processes when pytest-xdist is there
# (12 of the 16 cores), and name the slowest tests so that the part's time can be planned.
parallel=""
python3 -c "import xdist" 2>/dev/null && parallel="-n ${PYTEST_WORKERS:-12} --durations=15"
# The 8 KB NCCL all-reduce time a `tp` part measured, as tp_bench.py's option (nothing if none ran).
allreduce_arg() {
  python3 -c "import json; print('--allreduce-us', next(r['graph_us'] for r in json.load(open('$OUT/tp-allreduce.json'))['rows']
              if r['implementation'] == 'nccl'))" 2>/dev/null
}
# Runs a command with the SM clock, power and the reasons the clock is held down (0x4: the power cap)
# logged to the CSV file given first, every 100 ms.
with_clock_log() {
  local log=$1; shift
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 100 > "$log" 2>/dev/null & local smi=$!
  "$@"
  kill $smi
}
# Llama-3-8B's decode tiles named second, each "points kv" run given after the third argument, each in
# at most the first's seconds, into $OUT/<third>-<points>-<kv>.jsonl.
tile_runs() {
  local limit=$1 tiles=$2 prefix=$3; shift 3
  for run in "$@"; do
    read -r points kv <<< "$run"
    timeout "$limit" python3 benchmarks/studies/study_attention_tiles.py decode --points "$points" --shapes 4 --kv-dtype "$kv" \
      --jobs 12 --tiles "$tiles" --out "$OUT/$prefix-$points-$kv.jsonl" 2>&1 | tail -2
  done
}
kernel_tests() {
  python3 -m pytest -q -p no:cacheprovider $parallel -m gpu tests/kernels/test_triton_gpu.py 2>&1 \
    | tee "$OUT/gpu-kernel-tests.log" | tail -15
}
# In one process: each engine sizes its KV cache from the GPU's free memory. A shard I/N given: every
# N-th test from the I-th (the whole file takes ~13 minutes with a warm Triton cache).
engine_tests() {
  local shard=${1:+--shard $1} log=gpu-engine-tests${1:+-${1/\//of}}.log
  python3 -m pytest -q -p no:cacheprovider -m gpu $shard tests/test_gpu_engine.py 2>&1 | tee "$OUT/$log" | tail -15
}
for part in "$@"; do
  case $part in
    tests) kernel_tests; engine_tests ;;
    kernel-tests) kernel_tests ;;
    engine-tests) engine_tests ;;
    engine-tests-*/*) engine_tests "${part#engine-tests-}" ;;
    kernels)
      python3 benchmarks/suite/bench_kernels.py --out "$OUT/bench_kernels.json" 2>&1 | tail -25 ;;
    startup|latency|batch|throughput|features|kvcache)
      extra=""
      case $part in startup|features|kvcache) extra="--no-peer" ;; throughput) extra="--peer-requests 16" ;; esac
      timeout 400 python3 benchmarks/suite/run_engine_bench.py "$part" --out "$OUT/$part.json" $extra 2>&1 \
        | grep -v -e "it/s]" -e "^Loading" | tail -30 ;;
    weights|weights-*)
      # bf16 / FP8 / Q8_0 projections of Llama-3-8B and Qwen3-0.6B (weights-<shape>[,<shape>]: those shapes).
      shapes=""; [ "$part" = weights ] || shapes="--shapes ${part#weights-}"
      timeout 590 python3 benchmarks/suite/run_engine_bench.py weights $shapes --no-peer --out "$OUT/$part.json" 2>&1 \
        | grep -v -e "it/s]" -e "^Loading" | tail -40 ;;
    kvcache-long|kvcache-long-*)
      # 1,024 requests of 2,048 prompt + 1,024 output tokens on Llama-3-8B in the whole GPU's memory per KV cache
      # dtype (kvcache-long-auto,int8: those alone).
      dtypes=auto,fp8,int8; [ "$part" = kvcache-long ] || dtypes=${part#kvcache-long-}
      timeout 590 python3 benchmarks/suite/run_engine_bench.py kvcache-long --kv-cache-dtypes "$dtypes" \
        --out "$OUT/${part//,/-}.json" 2>&1 | grep -v -e "it/s]" -e "^Loading" | tail -8 ;;
    study-overlap)
      for kv in int8 bf16; do
        timeout 280 python3 benchmarks/studies/study_overlap.py --kv-dtype $kv --out "$OUT/overlap-$kv.json" 2>&1 | tail -7
      done ;;
    study-prefill-backends)
      timeout 300 python3 benchmarks/studies/study_prefill_backends.py --out "$OUT/prefill-backends.jsonl" 2>&1 | tail -40 ;;
    throughput-whole-peer)
      # Qwen3-0.6B's standard workload with transformers' generate_batch given all 256 requests too.
      timeout 590 python3 benchmarks/suite/run_engine_bench.py throughput --throughput-shapes qwen3-0.6b --peer-requests 256 \
        --out "$OUT/throughput-whole-peer.json" 2>&1 | grep -v -e "it/s]" -e "^Loading" | tail -10 ;;
    latency-*)
      # Batch-1 decode at 128, 1,024 and 4,096 tokens of context on the shapes named, e.g. latency-gemma3-4b,llama3-8b.
      timeout 590 python3 benchmarks/suite/run_engine_bench.py latency --shapes "${part#latency-}" --no-peer \
        --out "$OUT/${part//,/_}.json" 2>&1 | grep -v -e "it/s]" -e "^Loading" | tail -12 ;;
    models-*)
      timeout 590 python3 benchmarks/suite/run_engine_bench.py models --shapes "${part#models-}" \
        --peer-requests "${PEER_REQUESTS:-16}" \
        --out "$OUT/${part//,/_}.json" 2>&1 | grep -v -e "it/s]" -e "^Loading" | tail -30 ;;
    serve-qwen3-0.6b|serve-llama3-8b)
      timeout 560 python3 benchmarks/suite/serve_vs_engine.py --shape "${part#serve-}" --out "$OUT/$part.json" 2>&1 \
        | grep -v -e "it/s]" -e "^Loading" | tail -40 ;;
    profile)
      python3 benchmarks/profile/profile_step.py llama3-8b 1 2>&1 | tee "$OUT/profile-step.txt" | head -60 ;;
    workload-profile)
      python3 benchmarks/profile/profile_workload.py --out "$OUT/workload-profile.json" 2>&1 | grep -v "it/s]" | tail -60 ;;
    prefill-profile)
      python3 benchmarks/profile/profile_kernels.py --shape qwen3-0.6b --prefill --out "$OUT/prefill-profile.json" 2>&1 \
        | grep -v "it/s]" | tail -40 ;;
    study-argmax)
      python3 benchmarks/studies/study_argmax.py --out "$OUT/study-argmax.json" 2>&1 | tail -20 ;;
    study-softcap)
      python3 benchmarks/studies/study_softcap.py --out "$OUT/study-softcap.json" 2>&1 | tail -8 ;;
    study-skinny|study-skinny-large)
      rows=4,8,16,32,64; [ "$part" = study-skinny-large ] && rows=128,256,512,2048
      (cd benchmarks/studies && timeout 500 python3 study_skinny.py --rows $rows --out "$OUT/$part.json" 2>&1 \
        | grep -v Warning | tail -24) ;;
    study-skinny-dense)
      (cd benchmarks/studies && timeout 500 python3 study_skinny.py --rows 64,96,128,192,256 \
        --models llama3-8b,gemma3-4b,qwen3-0.6b --kinds bf16 --out "$OUT/$part.json" 2>&1 | grep -v Warning | tail -64) ;;
    study-q8-a8)
      (cd benchmarks/studies && timeout 500 python3 study_q8_a8.py --out "$OUT/study-q8-a8.json" 2>&1 | grep -v Warning \
        | tail -22) ;;
    study-gemv)
      python3 benchmarks/studies/study_gemv.py --out "$OUT/study-gemv.json" 2>&1 | tee "$OUT/study-gemv.log" | tail -60 ;;
    study-gemv-gemma3)
      timeout 560 python3 benchmarks/studies/study_gemv.py --models gemma3-4b,gemma3-27b --sweep \
        --out "$OUT/study-gemv-gemma3.json" 2>&1 | tee "$OUT/study-gemv-gemma3.log" | tail -40 ;;
    study-gemv-rows)
      # Several tiles of rows a program (a persistent GEMV) on the small models' projections.
      timeout 560 python3 benchmarks/studies/study_gemv.py --models gemma3-4b,llama3-8b --sweep --row-tiles 2,4,8 \
        --out "$OUT/study-gemv-rows.json" 2>&1 | tee "$OUT/study-gemv-rows.log" | tail -40 ;;
    spec)
      # The verify step's cost per batch size, with the speedup derived from spec-rewrite's tokens
      # per forward when that part ran first; then the standard workload with speculation on and off.
      tpf=$(python3 -c "import json; print(json.load(open('$OUT/spec-rewrite.json'))['rows'][0]['tokens_per_forward'])" \
            2>/dev/null)
      timeout 500 python3 benchmarks/suite/run_engine_bench.py spec --out "$OUT/spec.json" --no-peer \
        ${tpf:+--tokens-per-forward $tpf} 2>&1 | grep -v -e "it/s]" -e "^Loading" | tail -20 ;;
    spec-rewrite)
      timeout 400 python3 benchmarks/suite/spec_decode_rewrite.py --device cuda --out "$OUT/spec-rewrite.json" 2>&1 \
        | grep -v "it/s]" | tail -5 ;;
    study-attention-quantized)
      # Llama-3-8B's attention (head dim 128, group 4) over bf16, int8 and fp8 caches, every decode tile,
      # at 16 x 4k and 64 x 8k tokens.
      for kv in bf16 int8 fp8; do
        timeout 190 python3 benchmarks/studies/study_attention_tiles.py decode --points quantized --shapes 4 --kv-dtype $kv \
          --jobs 8 --out "$OUT/attention-tiles-quantized.jsonl" 2>&1 | tail -3
      done ;;
    study-attention-quantized-deep)
      # The one-byte decode tile's neighbours at 5 stages and deeper: 8 warps, or 64 / 32 keys (two programs
      # an SM), over int8 and fp8 caches at 16 x 4k and 64 x 8k tokens (Llama-3-8B's heads).
      for kv in int8 fp8; do
        timeout 200 python3 benchmarks/studies/study_attention_tiles.py decode --points quantized --shapes 4 --kv-dtype $kv \
          --jobs 12 --tiles "16,128,4,5;16,128,8,5;16,64,4,5;16,64,8,5;16,64,4,7;16,64,8,7;16,32,4,9;16,32,8,9;16,128,8,3" \
          --out "$OUT/attention-tiles-quantized-deep.jsonl" 2>&1 | tail -3
      done ;;
    study-attention-quantized-occupancy)
      # The one-byte decode tile against tiles whose register cap lets an SM hold 3-4 programs (12-16
      # warps) instead of 2, on decode batches of mixed lengths and at 16 x 4k and 64 x 8k tokens.
      tile_runs 190 "16,128,4,5;16,128,4,3,168;16,64,4,5,168;16,64,4,5,128;16,64,4,4,128;16,32,4,9,128;16,32,4,7,128" \
        attention-tiles-occupancy "ragged int8" "quantized int8" "ragged fp8" ;;
    study-attention-occupancy-bf16)
      # The 16-bit decode tiles against the same with a register cap that lets an SM hold 3 programs, at
      # head dims 256 (Gemma-3-4B) and 128 (Llama-3-8B), on the workloads' decode batches, unsplit.
      for run in "ragged 6 16,32,4,5;16,32,4,5,168;16,64,4,2;16,64,4,3,168" "short 6 16,32,4,5;16,32,4,5,168" \
                 "ragged 4 16,128,4,3;16,128,4,3,168;16,128,4,5,168"; do
        read -r points shape tiles <<< "$run"
        timeout 100 python3 benchmarks/studies/study_attention_tiles.py decode --points $points --shapes $shape \
          --jobs 14 --tiles "$tiles" --splits 1 --out "$OUT/occ-bf16-$points-$shape.jsonl" 2>&1 | tail -4
      done ;;
    study-attention-quantized-ragged)
      # The one-byte decode tile against 3 stages and 64 keys, at 1, 2 and 4 KV splits, on decode batches
      # of mixed lengths (ragged) and of 32-256 sequences over 192-1,024 tokens (short).
      tile_runs 175 "16,128,4,5;16,128,4,3;16,64,4,5;16,64,4,4" attention-tiles "ragged int8" "ragged fp8" "short int8" ;;
    study-warp-keys)
      (cd benchmarks/studies && timeout 300 python3 study_warp_keys.py --out "$OUT/study-warp-keys.json" 2>&1 | tail -8) ;;
    study-attention-short)
      # Llama-3-8B's and Qwen3-0.6B's decode attention at the static-decode and workload batches
      # (32-256 sequences, 192- and 1,024-token contexts): every decode tile at 1, 2 and 4 KV splits.
      timeout 500 python3 benchmarks/studies/study_attention_tiles.py decode --points short --shapes 4,5 --jobs 8 \
        --out "$OUT/attention-tiles-short.jsonl" 2>&1 | tail -10 ;;
    study-attention-short-gemma)
      # Head dim 256's decode tiles that fit 1-3 programs an SM (K/V stages of 16-64 keys), at 1, 2 and 4
      # KV splits: uniform short contexts for Gemma-3-4B's heads, then ragged batches for it and group 8.
      tiles="16,16,4,2;16,16,4,4;16,32,4,2;16,32,4,3;16,64,4,1;16,64,4,2;16,32,8,2;16,64,8,2"
      timeout 250 python3 benchmarks/studies/study_attention_tiles.py decode --points short --shapes 6 --jobs 8 \
        --tiles "$tiles" --out "$OUT/attention-tiles-short-gemma.jsonl" 2>&1 | tail -5
      timeout 250 python3 benchmarks/studies/study_attention_tiles.py decode --points ragged --shapes 6,1 --jobs 8 \
        --tiles "$tiles" --out "$OUT/attention-tiles-short-gemma.jsonl" 2>&1 | tail -5 ;;
    study-attention-ragged)
      # Decode batches of mixed lengths (Llama-3-8B's, Qwen3-0.6B's and Gemma-3-4B's heads), the engine's
      # tile at 1, 2 and 4 KV splits, each batch in arrival order and longest first.
      timeout 250 python3 benchmarks/studies/study_attention_tiles.py decode --points ragged --shapes 4,5,6 --chosen-only \
        --out "$OUT/attention-tiles-ragged.jsonl" 2>&1 | tail -12 ;;
    study-attention-splits|study-attention-splits-gemma)
      # Decode attention from 1 to 128 sequences, 192-8,192 tokens, at 1-16 KV splits: Llama-3-8B's heads,
      # or Gemma's (head dim 256 in groups of 2 and 8).
      shapes=4; [ "$part" = study-attention-splits-gemma ] && shapes=0,1
      timeout 500 python3 benchmarks/studies/study_attention_tiles.py decode --points splits --shapes $shapes --jobs 8 \
        --out "$OUT/$part.jsonl" 2>&1 | tail -24 ;;
    study-attention-prefill)
      # Llama-3-8B's prefill attention (a 2,048-token prompt; four 512-token chunks over 4k contexts), every tile.
      timeout 500 python3 benchmarks/studies/study_attention_tiles.py prefill --shapes 4 --jobs 8 \
        --out "$OUT/attention-tiles-prefill.jsonl" 2>&1 | tail -10 ;;
    study-prompt-attention)
      timeout 300 python3 benchmarks/studies/study_prompt_attention.py --out "$OUT/study-prompt-attention.json" 2>&1 | tail -40 ;;
    study-attention-prompt-splits)
      # Lone prompts and short chunks deep in long contexts at 1-16 KV splits in the engine's tile:
      # Llama-3-8B's heads and Gemma-3-4B's.
      timeout 300 python3 benchmarks/studies/study_attention_tiles.py prefill --points splits --chosen-only --shapes 4,6 \
        --out "$OUT/attention-prompt-splits.jsonl" 2>&1 | tail -12 ;;
    study-attention-prefill-quantized)
      for kv in int8 fp8; do
        timeout 250 python3 benchmarks/studies/study_attention_tiles.py prefill --shapes 4 --kv-dtype $kv --jobs 12 \
          --out "$OUT/attention-tiles-prefill-quantized.jsonl" 2>&1 | tail -3
      done ;;
    study-attention-prefill-pipelined-scales)
      # Prompt tiles over one-byte caches with the scales read in their tile's iteration (as decode
      # tiles read them) against a tile ahead, Llama-3-8B's heads.
      for kv in int8 fp8; do
        for flag in "" --pipelined-scales; do
          timeout 130 python3 benchmarks/studies/study_attention_tiles.py prefill --shapes 4 --kv-dtype $kv --jobs 8 $flag \
            --tiles "64,64,4,2;64,64,4,3;64,32,4,3;128,32,4,3" \
            --out "$OUT/attention-tiles-prefill-pipelined-scales.jsonl" 2>&1 | tail -2
        done
      done ;;
    study-l2-prefetch)
      timeout 300 python3 benchmarks/studies/study_l2_prefetch.py --out "$OUT/study-l2-prefetch.json" 2>&1 | tail -15 ;;
    study-attention-ncu)
      ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
      for kv in fp8 int8 bf16; do
        timeout 170 "$ncu" --clock-control none --set full --import-source yes -k regex:_paged_attention -s 1 -c 1 \
          -o "$OUT/attn-$kv" python3 benchmarks/profile/profile_attention_ncu.py --kv-dtype $kv 2>&1 | tail -2
        "$ncu" -i "$OUT/attn-$kv.ncu-rep" --page details --csv > "$OUT/attn-$kv-details.csv"
        "$ncu" -i "$OUT/attn-$kv.ncu-rep" --page source --csv --print-source sass > "$OUT/attn-$kv-sass.csv"
        python3 benchmarks/profile/profile_attention_ncu.py --stalls "$OUT/attn-$kv-sass.csv" > "$OUT/attn-$kv-stalls.txt"
        rm "$OUT/attn-$kv.ncu-rep" "$OUT/attn-$kv-sass.csv"  # what comes back: the details and the summary
        head -12 "$OUT/attn-$kv-stalls.txt"
      done ;;
    study-tunableop)
      # cuBLAS against the GEMM TunableOp picks by timing, Llama-3-8B's projections at 32-256 rows.
      timeout 400 python3 benchmarks/studies/study_tunableop.py --out "$OUT/study-tunableop.json" 2>&1 | tail -20 ;;
    study-fp8)
      (cd benchmarks/studies && timeout 560 python3 study_fp8.py --out "$OUT/study-fp8.json" 2>&1 \
        | tee "$OUT/study-fp8.log" | tail -60) ;;
    study-q8)
      timeout 560 python3 benchmarks/studies/study_q8.py --out "$OUT/study-q8.json" 2>&1 | tee "$OUT/study-q8.log" | tail -30 ;;
    kernel-profile-q8)
      python3 benchmarks/profile/profile_kernels.py --quantization q8_0 --out "$OUT/kernel-profile-q8.json" 2>&1 \
        | grep -v "it/s]" | tail -40 ;;
    structured)
      # JSON-schema requests against unconstrained ones, compile times and the masks' cost: the
      # embedded model, then a Llama-3-8B shape with a tokenizer of Llama 3's size trained on the spot.
      timeout 200 python3 benchmarks/suite/structured_outputs_bench.py --out "$OUT/structured-embedded.json" \
        --profile "$OUT/structured-embedded.prof" 2>&1 | grep -v "it/s]" | tee "$OUT/structured-embedded.log" | tail -8
      timeout 380 python3 benchmarks/suite/structured_outputs_bench.py --shape llama3-8b --tokenizer-vocab 128000 \
        --out "$OUT/structured-llama3-8b.json" --profile "$OUT/structured-llama3-8b.prof" 2>&1 \
        | grep -v -e "it/s]" -e "^Loading" | tee "$OUT/structured-llama3-8b.log" | tail -8 ;;
    sampling)
      timeout 400 python3 benchmarks/suite/sampling_bench.py --out "$OUT/sampling.json" 2>&1 | grep -v -e "it/s]" -e "^Loading" \
        | tail -80 ;;
    sampling-profile)
      timeout 300 python3 benchmarks/profile/profile_sampling.py --out "$OUT/sampling-profile.json" 2>&1 \
        | grep -v -e "it/s]" -e "^Loading" | tail -100 ;;
    study-sampling)
      timeout 300 python3 benchmarks/studies/study_sampling_tiles.py --out "$OUT/study-sampling.json" 2>&1 | tail -45 ;;
    tp)
      # Two GPUs: tensor-parallel parity (bf16) against one GPU, then all-reduces and TP=2 decode.
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tensor_parallel.py 2>&1 \
        | tee "$OUT/gpu-tp-tests.log" | tail -15
      timeout 590 python3 benchmarks/suite/tp_bench.py allreduce --out "$OUT/tp-allreduce.json" 2>&1 | tail -20
      timeout 590 python3 benchmarks/suite/tp_bench.py decode --out "$OUT/tp-decode.json" \
        $(allreduce_arg) \
        2>&1 | grep -v -e "it/s]" -e "^Loading" | tail -10 ;;
    tp70b)
      # Two GPUs: Llama-3-70B split over both (batch sweep, standard workload), the all-reduce time
      # in its floor from a tp part run before (else the benchmark's default).
      timeout 590 python3 benchmarks/suite/tp_bench.py 70b --out "$OUT/tp-70b.json" \
        $(allreduce_arg) \
        2>&1 | grep -v -e "it/s]" -e "^Loading" | tail -10 ;;
    kernel-profile|kernel-profile-b*)
      batch=${part#kernel-profile}; batch=${batch#-b}
      python3 benchmarks/profile/profile_kernels.py --batch "${batch:-1}" --out "$OUT/$part.json" 2>&1 | grep -v "it/s]" | tail -80 ;;
    kvcache-profile)
      # With the SM clock and power logged beside each run (the JSON gives each window's times).
      for kv in auto fp8 int8; do
        with_clock_log "$OUT/kvcache-profile-$kv-clocks.csv" timeout 150 python3 benchmarks/profile/profile_kernels.py \
          --batch 64 --context 8192 --kv-cache-dtype $kv --no-eager --out "$OUT/kvcache-profile-$kv.json" 2>&1 \
          | grep -v -e "it/s]" -e "^Loading" | tail -24
      done ;;
    kvcache-workload-profile)
      # The KV-bound workload's decode and prefill-carrying steps against their floors, per KV cache dtype,
      # with the clocks logged, then the decode step's kernels at its mean batch (85 over ~1,300 tokens).
      for kv in auto fp8 int8; do
        with_clock_log "$OUT/workload-profile-kv-bound-$kv-clocks.csv" timeout 170 python3 \
          benchmarks/profile/profile_workload.py --shape llama3-8b --kv-bound $kv --out "$OUT/workload-profile-kv-bound-$kv.json" \
          2>&1 | grep -e "^decode" -e "^mixed" -e "slowest"
      done
      for kv in auto int8; do
        timeout 150 python3 benchmarks/profile/profile_kernels.py --batch 85 --context 1280 --kv-cache-dtype $kv --no-eager \
          --out "$OUT/kernel-profile-b85-ctx1280-$kv.json" 2>&1 | grep -v -e "it/s]" -e "^Loading" | head -12
      done ;;
    startup-profile)
      python3 benchmarks/profile/profile_startup.py --out "$OUT/startup-profile.json" 2>&1 | grep -v -e "it/s]" -e "^Loading" | tail -90 ;;
    audit-host-waits)
      timeout 300 python3 benchmarks/profile/audit_host_waits.py --speculative --out "$OUT/host-waits.json" 2>&1 \
        | grep -v -e "it/s]" -e "^Loading" | tail -60 ;;
    ttft-profile)
      python3 benchmarks/profile/profile_ttft.py --out "$OUT/ttft-profile.json" 2>&1 | grep -v -e "it/s]" -e "^Loading" | tail -120 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done

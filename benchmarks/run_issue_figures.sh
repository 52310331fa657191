#!/usr/bin/env bash
# The runs behind BENCHMARKS.md (issues #2 and #3), one after another (2-core CPU: never in parallel).
# Prompt counts are cut to what a 3-hour session affords on this machine (stated in BENCHMARKS.md).
set -euo pipefail
OUT=${OUT:-bench-out}
COMMON="--threads 2 --compare-transformers --dataset humaneval,gsm8k,mt_bench,wmt16"

# Qwen2.5-Coder 1.5B target / 0.5B draft, float32 (issue #2 main figure, issue #3 Qwen figure)
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype float32 $COMMON --limit 5 \
  --max-new-tokens 64 --methods autoregressive,draft_model,prompt_lookup,anpd --out $OUT/qwen-fp32

# Gemma 3 270M, float32: prompt lookup and ANPD vs transformers' prompt lookup
speculum bench --model gemma-3-270m --dtype float32 $COMMON --limit 5 --max-new-tokens 128 \
  --methods autoregressive,prompt_lookup,anpd --out $OUT/gemma-fp32

# Engine overhead with the same kernels as transformers (no prepacking)
speculum bench --model gemma-3-270m --dtype float32 --threads 2 --no-prepack --dataset humaneval --limit 2 \
  --max-new-tokens 64 --methods autoregressive,hf_generate --out $OUT/gemma-fp32-stock

# bfloat16 runs (this CPU has no native bf16: verification cost grows with K)
speculum bench --model gemma-3-270m --dtype bfloat16 $COMMON --limit 2 --max-new-tokens 128 \
  --methods autoregressive,prompt_lookup,anpd --out $OUT/gemma-bf16
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype bfloat16 --threads 2 \
  --compare-transformers --dataset humaneval,gsm8k,mt_bench --limit 1 --max-new-tokens 64 \
  --methods autoregressive,draft_model,prompt_lookup,anpd --out $OUT/qwen-bf16

# Issue #6: Gemma before/after (run the same command from a worktree of commit 6cfc00f with
# PYTHONPATH=<worktree>/src python -m speculum.cli ... for the "before" row), then the overheads
speculum bench --model gemma-3-270m --dtype float32 $COMMON --limit 5 --max-new-tokens 128 \
  --methods autoregressive,prompt_lookup,anpd --out $OUT/gemma-fp32-after6
python benchmarks/engine_overheads.py

# Issue #7: Qwen pair, dtype auto (bfloat16 on AVX-512-bf16 CPUs); parameters tuned on MBPP
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b $COMMON --limit 5 --max-new-tokens 64 \
  --methods "autoregressive,draft_model,draft_model:length_policy=fixed,num_speculative_tokens=4,ouroboros:num_speculative_tokens=4,phrase_drafting=false,lookahead:window_size=4,ngram_size=4,guess_set_size=4" \
  --out $OUT/qwen-issue7
python benchmarks/near_ties.py $OUT/qwen-issue7 --model qwen2.5-coder-1.5b --dtype bfloat16

# Issue #7, second pass: Ouroboros tuned on MBPP with `speculum tune` (writes the config file the
# report run reads), then the 128-token report run, then the replay studies on its references.
# The MBPP exploration run (its outputs also pre-warm the pool in the warm/cold study):
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mbpp --limit 4 \
  --max-new-tokens 64 --methods "autoregressive,draft_model:length_policy=fixed,num_speculative_tokens=4,ouroboros:num_speculative_tokens=4,phrase_drafting=false,ouroboros:num_speculative_tokens=4,phrase_drafting=false,context_phrases=true,ouroboros:num_speculative_tokens=4,window_size=0,draft_guesses=2,context_phrases=true,ouroboros:num_speculative_tokens=6,window_size=0,draft_guesses=2,context_phrases=true" \
  --out $OUT/tune3
speculum tune --method ouroboros --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dataset mbpp --limit 5 \
  --max-new-tokens 64 --threads 2 --sweeps 2 --out benchmarks/results/ouroboros-qwen-tuned.json
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b $COMMON --limit 5 --max-new-tokens 128 \
  --methods "autoregressive,draft_model,draft_model:length_policy=fixed,num_speculative_tokens=4,benchmarks/results/ouroboros-qwen-tuned.json,lookahead:window_size=4,ngram_size=4,guess_set_size=4" \
  --out $OUT/qwen-issue7-128
python benchmarks/ouroboros_studies.py $OUT/qwen-issue7-128 --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --config benchmarks/results/ouroboros-qwen-tuned.json --warm-records $OUT/tune3 --max-new-tokens 64 \
  --out benchmarks/results/ouroboros-studies.md --plot benchmarks/plots/ouroboros_studies.png

# Issue #8 (SpecDec++): the heads (data ~11 min alone, training seconds; "paper" = the paper's
# head: hidden state where the candidate is the input, no confidence input), the recipe sweep on the
# cached data, the default head shipped in the package, the tuning front on prompts 5-7 of each set
# (h, K and the confidence threshold are chosen there), Figure 4 on the report prompts (references
# from the issue #7 128-token run), then the timed runs on the report prompts.
speculum train acceptance-head --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out $OUT/heads/qwen-0.5b-early
cp $OUT/heads/qwen-0.5b-early/acceptance_data.safetensors $OUT/heads/qwen-0.5b-paper/
speculum train acceptance-head --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out $OUT/heads/qwen-0.5b-paper \
  --no-early --no-confidence-input --epochs 2 --lr 1e-4
python benchmarks/acceptance_head_sweep.py $OUT/heads/qwen-0.5b-early/acceptance_data.safetensors \
  --lr 1e-3,1e-4,3e-5 --epochs 3 --out benchmarks/results/acceptance-head-sweep.md
python benchmarks/ship_acceptance_head.py $OUT/heads/qwen-0.5b-early qwen2.5-coder-0.5b
HEADS="--head paper=$OUT/heads/qwen-0.5b-paper --head early=src/speculum/data/heads/qwen2.5-coder-0.5b"
python benchmarks/specdecpp_front.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b $HEADS \
  --datasets humaneval,gsm8k,mt_bench,wmt16 --first 5 --limit 3 --cost --out benchmarks/results/specdecpp-tune-front.md
python benchmarks/specdecpp_front.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b $HEADS \
  --records $OUT/qwen-issue7-128 --cost --out benchmarks/results/specdecpp-front.md --plot benchmarks/plots/specdecpp_front.png
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --out $OUT/qwen-issue8 \
  --methods "autoregressive,hf_assisted,draft_model:length_policy=fixed,num_speculative_tokens=2,draft_model:length_policy=fixed,num_speculative_tokens=4,draft_model:length_policy=confidence,confidence_threshold=0.8,num_speculative_tokens=20,draft_model:length_policy=specdecpp,stop_threshold=0.5,draft_model:length_policy=specdecpp,acceptance_head=$OUT/heads/qwen-0.5b-paper,stop_threshold=0.7"
# Temperature 1.0: a head trained on T=1 labels (shipped beside the greedy one), the timed run
# (64 tokens), then Figure 4 from sampled chains over the run's own T=1 outputs.
speculum train acceptance-head --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --temperature 1 --out $OUT/heads/qwen-0.5b-t1
python benchmarks/ship_acceptance_head.py $OUT/heads/qwen-0.5b-t1 qwen2.5-coder-0.5b-t1
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --limit 5 --max-new-tokens 64 --temperature 1 --seed 0 --out $OUT/qwen-issue8-t1 \
  --methods "autoregressive,hf_assisted,draft_model:length_policy=fixed,num_speculative_tokens=2,draft_model:length_policy=fixed,num_speculative_tokens=4,draft_model:length_policy=confidence,confidence_threshold=0.8,num_speculative_tokens=20,draft_model:length_policy=specdecpp,stop_threshold=0.5,draft_model:length_policy=specdecpp,acceptance_head=$OUT/heads/qwen-0.5b-t1,stop_threshold=0.5"
python benchmarks/specdecpp_front.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --head early=src/speculum/data/heads/qwen2.5-coder-0.5b --head early-t1=src/speculum/data/heads/qwen2.5-coder-0.5b-t1 \
  --records $OUT/qwen-issue8-t1 --temperature 1 --reps 4 \
  --out benchmarks/results/specdecpp-front-t1.md --plot benchmarks/plots/specdecpp_front_t1.png

# Issue #9 (CTC-drafter, Medusa) on Gemma 3 270M: one data pass (the default texts teacher-forced,
# plus the target's own greedy continuations of their prompts, 128 tokens), both kinds of heads on
# it, β by exact replay and `speculum tune` (float32 cost curve) on the tuning prompts (each set's
# prompts 6-10; tune-prompts.jsonl holds 6-8) to choose the tree size, shipping, then the timed runs
# on the report prompts (the first five of each set) in bfloat16 (auto here) and float32, and the tables.
speculum train medusa --model gemma-3-270m --generate 128 --out $OUT/heads/gemma-g2-medusa
speculum train ctc-drafter --model gemma-3-270m --generate 128 --epochs 3 --out $OUT/heads/gemma-g2-ctc \
  --data $OUT/heads/gemma-g2-medusa/distill_data.safetensors
python benchmarks/head_acceptance.py --model gemma-3-270m --dataset humaneval,gsm8k,mt_bench --skip 5 --limit 5 \
  --methods "anpd;medusa:heads=$OUT/heads/gemma-g2-medusa;medusa:heads=$OUT/heads/gemma-g2-medusa,tree_nodes=24;ctc:heads=$OUT/heads/gemma-g2-ctc;ctc:heads=$OUT/heads/gemma-g2-ctc,tree_nodes=24"
python -c "
import json; from speculum.bench.datasets import load_dataset
rows = [dict(question_id=p.question_id, category=p.category, turns=[p.text])
        for n in ('humaneval', 'gsm8k', 'mt_bench') for p in load_dataset(n, 8)[5:8]]
open('$OUT/tune-prompts.jsonl', 'w').write(''.join(json.dumps(r) + '\\n' for r in rows))"
for M in medusa ctc; do
  speculum tune --method $M --param heads=$OUT/heads/gemma-g2-$M --dtype float32 --dataset $OUT/tune-prompts.jsonl \
    --limit 9 --max-new-tokens 64 --no-confirm --threads 2
done
python benchmarks/ship_draft_heads.py $OUT/heads/gemma-g2-medusa gemma-3-270m-medusa --tree-nodes 12
python benchmarks/ship_draft_heads.py $OUT/heads/gemma-g2-ctc gemma-3-270m-ctc --tree-nodes 12
# bfloat16, 24-node trees (Table 1/2, Figure 3), then float32 and bfloat16 with the shipped 12-node trees
speculum bench --model gemma-3-270m --threads 2 --dataset mt_bench,gsm8k,humaneval --limit 5 --max-new-tokens 128 \
  --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,medusa:tree_nodes=24,ctc:tree_nodes=24,medusa:tree_nodes=24,ctc_transform=true,ctc:tree_nodes=24,ctc_transform=false" \
  --out $OUT/gemma-issue9
python benchmarks/head_drafters_report.py $OUT/gemma-issue9 --out benchmarks/results/head-drafters-gemma.md \
  --plot benchmarks/plots/head_drafters_time.png \
  --ablation "medusa:tree_nodes=24;medusa:tree_nodes=24,ctc_transform=true;ctc:tree_nodes=24,ctc_transform=false;ctc:tree_nodes=24"
speculum bench --model gemma-3-270m --dtype float32 --threads 2 --dataset mt_bench,gsm8k,humaneval --limit 5 \
  --max-new-tokens 128 --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,medusa,ctc" --out $OUT/gemma-issue9-fp32-12
python benchmarks/head_drafters_report.py $OUT/gemma-issue9-fp32-12 --out benchmarks/results/head-drafters-gemma-fp32.md
speculum bench --model gemma-3-270m --threads 2 --dataset mt_bench,gsm8k,humaneval --limit 5 --max-new-tokens 128 \
  --methods "autoregressive,medusa,ctc" --out $OUT/gemma-issue9-bf16-12

# Issue #17 (review mends): the heads again on aligned data (greedy and T=1; the paper head from the
# same data), the recipe sweep, the tuning front (h chosen there: 0.3), the timed greedy and T=1 runs,
# Figure 4 from the greedy run's references, then Ouroboros re-tuned with exact replay and its studies.
speculum train acceptance-head --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --regenerate --out $OUT/heads/qwen-0.5b-early
python benchmarks/ship_acceptance_head.py $OUT/heads/qwen-0.5b-early qwen2.5-coder-0.5b
mkdir -p $OUT/heads/qwen-0.5b-paper && cp $OUT/heads/qwen-0.5b-early/acceptance_data.safetensors $OUT/heads/qwen-0.5b-paper/
speculum train acceptance-head --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out $OUT/heads/qwen-0.5b-paper \
  --no-early --no-confidence-input --epochs 2 --lr 1e-4
python benchmarks/acceptance_head_sweep.py $OUT/heads/qwen-0.5b-early/acceptance_data.safetensors \
  --lr 1e-3,1e-4,3e-5 --epochs 3 --out benchmarks/results/acceptance-head-sweep.md
speculum train acceptance-head --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --temperature 1 --threads 2 \
  --regenerate --out $OUT/heads/qwen-0.5b-t1
python benchmarks/ship_acceptance_head.py $OUT/heads/qwen-0.5b-t1 qwen2.5-coder-0.5b-t1
HEADS="--head paper=$OUT/heads/qwen-0.5b-paper --head early=src/speculum/data/heads/qwen2.5-coder-0.5b"
python benchmarks/specdecpp_front.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b $HEADS \
  --datasets humaneval,gsm8k,mt_bench,wmt16 --first 5 --limit 3 --cost --out benchmarks/results/specdecpp-tune-front.md
M="--model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2"
DM="draft_model:length_policy=fixed,num_speculative_tokens=2,draft_model:length_policy=fixed,num_speculative_tokens=4,draft_model:length_policy=confidence,confidence_threshold=0.8,num_speculative_tokens=20"
speculum bench $M --dataset humaneval,gsm8k,mt_bench,wmt16 --limit 5 --max-new-tokens 128 --out $OUT/qwen-issue17 \
  --methods "autoregressive,hf_assisted,$DM,draft_model:length_policy=specdecpp,stop_threshold=0.3"
speculum bench $M --dataset humaneval,gsm8k,mt_bench,wmt16 --limit 5 --max-new-tokens 64 --temperature 1 --seed 0 \
  --out $OUT/qwen-issue17-t1 --methods "autoregressive,hf_assisted,$DM,draft_model:length_policy=specdecpp,stop_threshold=0.5"
speculum tune --method ouroboros $M --dataset mbpp --limit 5 --max-new-tokens 64 --sweeps 2 \
  --out benchmarks/results/ouroboros-qwen-tuned.json | tee benchmarks/results/ouroboros-qwen-tune.log
python benchmarks/specdecpp_front.py $M $HEADS --records $OUT/qwen-issue17 --cost \
  --out benchmarks/results/specdecpp-front.md --plot benchmarks/plots/specdecpp_front.png
speculum bench $M --dataset mbpp --limit 4 --max-new-tokens 64 --methods autoregressive --out $OUT/mbpp-plain
python benchmarks/ouroboros_studies.py $OUT/qwen-issue17 --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --config benchmarks/results/ouroboros-qwen-tuned.json --warm-records $OUT/mbpp-plain --max-new-tokens 64 \
  --out benchmarks/results/ouroboros-studies.md --plot benchmarks/plots/ouroboros_studies.png
python benchmarks/confirm_ouroboros_tuned.py

# ---- issue #18: the controller, auto, machine defaults (Gemma 3 270M float32 and bfloat16, Qwen pair bfloat16)
G="--model gemma-3-270m --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 --limit 5"
GM="autoregressive,hf_generate,hf_prompt_lookup,anpd:controller=false,anpd:controller=true,prompt_lookup:controller=false,prompt_lookup:controller=true,lookahead:controller=false,lookahead:controller=true,medusa:controller=false,medusa:controller=true,ctc:controller=false,ctc:controller=true,auto"
GB="autoregressive,hf_generate,anpd:controller=true,prompt_lookup:controller=true,lookahead:controller=true,medusa:controller=false,medusa:controller=true,ctc:controller=false,ctc:controller=true,auto"
Q="--model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 --limit 5"
QM="autoregressive,hf_assisted,draft_model:controller=false,draft_model:controller=true,ouroboros:controller=false,ouroboros:controller=true,auto"
speculum bench $G --dtype float32 --max-new-tokens 128 --out $OUT/i18/gemma-fp32-v2 --methods "$GM"
speculum bench $Q --max-new-tokens 64 --out $OUT/i18/qwen-bf16-v2 --methods "$QM"
# the defaults as shipped after it (draft_model and ouroboros without the controller)
speculum bench $Q --max-new-tokens 64 --out $OUT/i18/qwen-bf16-v3 \
  --methods "autoregressive,hf_assisted,draft_model,ouroboros,ouroboros:controller=true,anpd,auto"
speculum bench $G --dtype float32 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/gemma-fp32-t1 --methods "$GM"
python benchmarks/controller_plain_rounds.py --limit 3 --repeats 2
speculum bench $G --dtype bfloat16 --max-new-tokens 128 --out $OUT/i18/gemma-bf16 --methods "$GB"
# second pass: faster sampling, a controller per sampling regime, cheaper probes, auto's whole draft chain
GC="autoregressive,hf_generate,hf_prompt_lookup,anpd:controller=true,prompt_lookup:controller=true,lookahead:controller=true,medusa:controller=true,ctc:controller=true,auto"
speculum bench $G --dtype float32 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/gemma-fp32-t1-v4 --methods "$GC"
speculum bench $G --dtype float32 --max-new-tokens 128 --out $OUT/i18/gemma-fp32-v4 --methods "$GC"
speculum bench $Q --max-new-tokens 64 --out $OUT/i18/qwen-bf16-v4 --methods "autoregressive,hf_assisted,draft_model,ouroboros,anpd,auto"
# Ouroboros with and without the controller (before/after its chain is kept whole: check, check2)
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k --limit 5 --max-new-tokens 64 \
  --out $OUT/i18/qwen-ouro-check2 --methods "autoregressive,ouroboros,ouroboros:controller=false"
# fourth pass (2026-11-25): the Qwen pair at T=1 (auto's draft chain first), then auto's paired gates
speculum bench $Q --max-new-tokens 64 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-64-v2 \
  --methods "autoregressive,hf_generate,hf_assisted,draft_model,auto"
speculum bench $G --dtype float32 --max-new-tokens 128 --out $OUT/i18/gemma-fp32-v5 \
  --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,medusa,auto"
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,mt_bench --limit 5 \
  --max-new-tokens 64 --out $OUT/i18/qwen-greedy-v5 --methods "autoregressive,hf_assisted,draft_model,auto"
speculum bench $G --dtype float32 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/gemma-fp32-t1-v5 \
  --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,medusa,ctc,auto"
# the same Gemma run's auto at 9b4fafb (the gates before they were paired), from a worktree of it
git worktree add /tmp/old-gate 9b4fafb && PYTHONPATH=/tmp/old-gate/src speculum bench $G --dtype float32 \
  --max-new-tokens 128 --out $OUT/i18/gemma-fp32-oldgate --methods "autoregressive,auto"
# fifth pass: seeded sampling by position noise (the seed's text with every method, the controller on):
# what it costs a draft model's acceptance (exact replay of the T=1 texts above), then T=1 timed again
python benchmarks/coupled_acceptance.py $OUT/i18/qwen-t1-64-v2 --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
speculum bench $G --dtype float32 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/gemma-fp32-t1-v6 \
  --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
speculum bench $Q --max-new-tokens 64 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-64-v3 \
  --methods "autoregressive,hf_generate,hf_assisted,draft_model,auto"
# ... then the controller's patient back-off (a win halves it once per three wins), T=1 and greedy
speculum bench $G --dtype float32 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/gemma-fp32-t1-v7 \
  --methods "autoregressive,lookahead,anpd,auto"
speculum bench $G --dtype float32 --max-new-tokens 128 --out $OUT/i18/gemma-fp32-greedy-v7 --methods "autoregressive,anpd,lookahead,auto"
speculum bench $G --dtype float32 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/gemma-fp32-t1-v8 \
  --methods "autoregressive,prompt_lookup,medusa,ctc,auto"
# sixth pass: a draft model's catching up not held against a round (Qwen T=1), then bfloat16 with the
# LM head lazy (v9), eager where 8 rows cost about one (v10), and one-token forwards' cost
speculum bench $Q --max-new-tokens 64 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-64-v4 \
  --methods "autoregressive,hf_generate,hf_assisted,draft_model,auto"
speculum bench $G --dtype bfloat16 --max-new-tokens 128 --out $OUT/i18/gemma-bf16-greedy-v9 \
  --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
speculum bench $G --dtype bfloat16 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/gemma-bf16-t1-v10 \
  --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
speculum bench $G --dtype bfloat16 --max-new-tokens 128 --out $OUT/i18/gemma-bf16-greedy-v10 \
  --methods "autoregressive,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
speculum bench $G --dtype float32 --max-new-tokens 128 --out $OUT/i18/gemma-fp32-greedy-v10 --methods "autoregressive,anpd,lookahead,auto"
for M in qwen2.5-coder-1.5b gemma-3-270m; do
  python benchmarks/verify_cost.py $M --dtypes float32 --ks 1,2,3,4,8 --reps 7 --threads 2 --heads last
done
# seventh pass: is dtype=auto right? both dtypes end to end, interleaved (then bfloat16 needs to be
# predicted 15% faster); bfloat16 greedy with the shipped code; the Qwen pair greedy on all four sets
python benchmarks/dtype_choice.py --methods autoregressive,auto,anpd --threads 2 \
  --out benchmarks/results/issue18-dtype-choice-gemma.json
speculum bench $G --dtype bfloat16 --max-new-tokens 128 --out $OUT/i18/gemma-bf16-greedy-v11 \
  --methods "autoregressive,lookahead,medusa,ctc,prompt_lookup,anpd,auto"
speculum bench $Q --max-new-tokens 64 --out $OUT/i18/qwen-greedy-64-v6 --methods "autoregressive,hf_assisted,draft_model,ouroboros,auto"
# eighth pass: the Qwen pair at the protocol's 128 tokens, greedy and T=1 (about an hour each; a stopped run
# continues with the same command plus --resume)
speculum bench $Q --max-new-tokens 128 --out $OUT/i18/qwen-greedy-128-v7 --methods "autoregressive,hf_assisted,draft_model,ouroboros,auto"
speculum bench $Q --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-128-v5 \
  --methods "autoregressive,hf_assisted,draft_model,ouroboros,auto"
# ninth pass: Ouroboros' draft picks by a seeded request's noise; Ouroboros tuned for T=1 on MT-bench 101-105
python - <<'PY'
import json
from speculum.bench.datasets import load_dataset
with open("/tmp/mt101-105.jsonl", "w") as f:
    for p in load_dataset("mt_bench")[20:25]:
        f.write(json.dumps({"question_id": p.question_id, "turns": [p.text]}) + "\n")
PY
speculum tune --method ouroboros --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dataset /tmp/mt101-105.jsonl \
  --limit 5 --max-new-tokens 64 --chat --temperature 1 --seed 0 --sweeps 1 --threads 2 \
  --out benchmarks/results/ouroboros-qwen-tuned-t1.json
speculum bench $Q --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-128-v6 \
  --methods "autoregressive,hf_assisted,draft_model,ouroboros,auto"
# tenth pass: Ouroboros' T=1 setting the default for sampled requests; auto with Ouroboros as its draft-model part
speculum bench $Q --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-128-v7 \
  --methods "autoregressive,hf_assisted,ouroboros,auto"
speculum bench $Q --max-new-tokens 64 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-64-auto-ouroboros \
  --methods "autoregressive,hf_assisted,ouroboros,auto,benchmarks/results/auto-with-ouroboros.json"
# eleventh pass: auto's parts chosen on the tuning prompts (/tmp/mt101-105.jsonl as in the ninth pass, and MBPP 1-5),
# greedy and T=1 (auto there was still draft_model + heads, now auto-draft-model-heads.json); MBPP 1-2 of the greedy
# run were run again alone (a test run had shared the cores)
TUNE="--model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset /tmp/mt101-105.jsonl,mbpp --limit 5 --max-new-tokens 64"
TUNE_METHODS="autoregressive,ouroboros,benchmarks/results/auto-draft-model-heads.json,benchmarks/results/auto-with-ouroboros.json,benchmarks/results/auto-medusa-ouroboros.json"
speculum bench $TUNE --out $OUT/i18/tuning-greedy-64 --methods "$TUNE_METHODS"
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mbpp --limit 2 --max-new-tokens 64 \
  --out $OUT/i18/tuning-greedy-64-mbpp12 --methods "$TUNE_METHODS"
speculum bench $TUNE --temperature 1 --seed 0 --out $OUT/i18/tuning-t1-64 --methods "$TUNE_METHODS"
# ... then the report sets at 128 tokens with auto's new default parts, T=1 and greedy
speculum bench $Q --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-128-v8 \
  --methods "autoregressive,hf_assisted,ouroboros,auto"
speculum bench $Q --max-new-tokens 128 --out $OUT/i18/qwen-greedy-128-v8 --methods "autoregressive,hf_assisted,ouroboros,auto"
for run in gemma-fp32-v2 qwen-bf16-v2 qwen-bf16-v3 gemma-fp32-t1 gemma-bf16 gemma-fp32-t1-v4 gemma-fp32-v4 qwen-bf16-v4 \
    qwen-t1-64-v2 gemma-fp32-v5 qwen-greedy-v5 gemma-fp32-oldgate gemma-fp32-t1-v5 gemma-fp32-t1-v6 qwen-t1-64-v3 \
    gemma-fp32-t1-v7 gemma-fp32-greedy-v7 gemma-fp32-t1-v8 qwen-t1-64-v4 gemma-bf16-greedy-v9 gemma-bf16-t1-v10 \
    gemma-bf16-greedy-v10 gemma-fp32-greedy-v10 gemma-bf16-greedy-v11 qwen-greedy-64-v6 qwen-greedy-128-v7 \
    qwen-t1-128-v5 qwen-t1-128-v6 qwen-t1-128-v7 qwen-t1-64-auto-ouroboros qwen-t1-128-v8 qwen-greedy-128-v8; do
  python benchmarks/controller_bars.py $OUT/i18/$run/summary.json
done

# ---- issue #19 (batching), first measurement: what a forward over B rows of K tokens costs
python benchmarks/batch_cost.py gemma-3-270m --dtype float32 --threads 2 --reps 3
python benchmarks/batch_cost.py qwen2.5-coder-1.5b --dtype bfloat16 --threads 2 --reps 3 --batches 1,2,4,8,16 --ks 1,2,4,8

# ---- issue #19: batched decoding in the engine (B = 1, 4, 16; HF generate on the same left-padded batch)
python benchmarks/batch_throughput.py gemma-3-270m --threads 2 --batches 1,4,16 \
    --methods autoregressive,prompt_lookup,anpd --max-new-tokens 128 --groups 2 \
    --out benchmarks/results/issue19-batch-throughput-gemma-v2.md
# ---- issue #19: continuous batching in speculum serve, against the same server one request at a time
python benchmarks/server_load.py --model gemma-3-270m --methods autoregressive,anpd --concurrency 1,4,16 \
    --requests 16 --max-tokens 128 --dataset humaneval,gsm8k --limit 16 \
    --out benchmarks/results/issue19-server-load-gemma-batched.md
python benchmarks/server_load.py --model gemma-3-270m --methods autoregressive,anpd --concurrency 1,16 \
    --requests 16 --max-tokens 128 --dataset humaneval,gsm8k --limit 16 --serve-args "--max-batch 1" \
    --out benchmarks/results/issue19-server-load-gemma-one-at-a-time.md
# ---- issue #19: the Qwen server at 8 clients, without and with the 0.5B draft, batched and one at a time
QS="--model qwen2.5-coder-1.5b --concurrency 8 --requests 8 --max-tokens 64 --dataset humaneval,gsm8k --limit 8 --warmup 1"
python benchmarks/server_load.py $QS --methods autoregressive --out benchmarks/results/issue19-server-load-qwen-plain-batched.md
python benchmarks/server_load.py $QS --methods autoregressive --serve-args "--max-batch 1" --out benchmarks/results/issue19-server-load-qwen-plain-one.md
python benchmarks/server_load.py $QS --draft qwen2.5-coder-0.5b --methods auto --out benchmarks/results/issue19-server-load-qwen-draft-batched.md
python benchmarks/server_load.py $QS --draft qwen2.5-coder-0.5b --methods auto --serve-args "--max-batch 1" --out benchmarks/results/issue19-server-load-qwen-draft-one.md
# ---- issue #19: the engine on the Qwen pair, and memory over 1,000 batched requests
python benchmarks/batch_throughput.py qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --batches 1,4,8 \
    --methods autoregressive,anpd,draft_model --max-new-tokens 64 --groups 1 --out benchmarks/results/issue19-batch-throughput-qwen-bf16.md
python benchmarks/server_load.py --model gemma-3-270m --methods autoregressive,anpd --concurrency 1 --requests 4 --max-tokens 16 \
    --rss 10,100,500,1000 --rss-max-tokens 32 --rss-concurrency 16 --dataset humaneval,gsm8k,mt_bench --limit 40 \
    --out benchmarks/results/issue19-server-rss-gemma-batched.md
# ---- issue #19, second pass: batch verdicts (engine), the server against itself one request at a time in the same run
python benchmarks/batch_throughput.py gemma-3-270m --threads 2 --batches 1,4,16 \
    --methods autoregressive,prompt_lookup,anpd --max-new-tokens 128 --groups 2 \
    --out benchmarks/results/issue19-batch-throughput-gemma-v3.md
python benchmarks/server_load.py --model gemma-3-270m --methods autoregressive,anpd --concurrency 1,16 \
    --requests 16 --max-tokens 128 --dataset humaneval,gsm8k --limit 16 --versus "--max-batch 1" \
    --out benchmarks/results/issue19-server-load-gemma-versus.md
python benchmarks/server_load.py $QS --methods autoregressive --versus "--max-batch 1" \
    --out benchmarks/results/issue19-server-load-qwen-plain-versus.md
python benchmarks/server_load.py $QS --draft qwen2.5-coder-0.5b --methods auto --versus "--max-batch 1" \
    --out benchmarks/results/issue19-server-load-qwen-draft-versus.md
# ---- issue #18, third pass: Ouroboros' phrases under the controller (exploration, run depths, drafting time)
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k \
    --limit 5 --max-new-tokens 64 --methods "autoregressive,ouroboros,ouroboros:controller=false" \
    --out $OUT/i18/qwen-ouro-third-pass  # summary.md: benchmarks/results/issue18-qwen-ouroboros-*.md
# ---- issue #20: data for heads on the Qwen2.5-Coder 1.5B (its own continuations, 720 prompts x 256 tokens), then
# short training probes (16,000 examples, one epoch) compared by exact replay on the tuning prompts (mbpp[:6])
I20=$OUT/i20
TEXTS="mbpp[100:200],gsm8k[100:200],wmt16[100:200],mt_bench[20:]"  # 360 texts: no report prompt (first 20 per set), no tuning prompt (mbpp[:100])
speculum train ctc-drafter --model qwen2.5-coder-1.5b --out $I20/qwen-ctc --texts "$TEXTS" --generate 256 --threads 2 \
    --epochs 2 --max-examples 120000    # resumable: rerun the same command after an interruption
probe() { speculum train $1 --model qwen2.5-coder-1.5b --out $I20/probe-$2 --texts "$TEXTS" --generate 256 --threads 2 \
    --epochs 1 --max-examples 16000 --precision bfloat16 --data $I20/qwen-ctc/distill_data.safetensors "${@:3}"; }
# (the first pass's probes: the module without per-slot blocks)
probe ctc-drafter float32 --precision float32 --no-slot-blocks
probe ctc-drafter lr3e-4 --lr 3e-4 --no-slot-blocks
probe ctc-drafter std --standardize --no-slot-blocks
probe ctc-drafter std-lr3e-4 --standardize --lr 3e-4 --no-slot-blocks
probe medusa medusa
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dataset mbpp --skip 0 --limit 6 --max-new-tokens 64 \
    --batch 6 --threads 2 --methods "ctc:heads=$I20/qwen-ctc;ctc:heads=$I20/probe-float32;ctc:heads=$I20/probe-lr3e-4;ctc:heads=$I20/probe-std;ctc:heads=$I20/probe-std-lr3e-4;medusa:heads=$I20/probe-medusa;anpd"
# second pass: every slot its own residual block (now the default), and trees of the likeliest prefixes (tree=prefix)
probe ctc-drafter slots --standardize --lr 3e-4
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dataset mbpp --skip 0 --limit 6 --max-new-tokens 64 \
    --batch 6 --threads 2 --methods "ctc:heads=$I20/probe-slots;ctc:heads=$I20/probe-slots,tree=prefix;ctc:heads=$I20/probe-slots,tree=prefix,top_k=8;ctc:heads=$I20/probe-std-lr3e-4,tree=prefix"
# the full heads: 2 epochs x 72,000 examples each, on the same data
full() { speculum train $1 --model qwen2.5-coder-1.5b --out $I20/full-$2 --texts "$TEXTS" --generate 256 --threads 2 \
    --epochs 2 --max-examples 72000 --data $I20/qwen-ctc/distill_data.safetensors "${@:3}"; }
full medusa medusa
full ctc-drafter ctc --standardize --lr 3e-4
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dataset humaneval,gsm8k,mt_bench,wmt16 --skip 0 --limit 20 \
    --max-new-tokens 128 --batch 16 --threads 2 \
    --methods "medusa:heads=$I20/full-medusa;ctc:heads=$I20/full-ctc;ctc:heads=$I20/full-ctc,tree=prefix;ctc:heads=$I20/full-ctc,tree=prefix,top_k=8;anpd"
for M in medusa ctc; do  # the tree on the tuning prompts (results/issue20-qwen-tuned-*.json, heads renamed)
  speculum tune --method $M --model qwen2.5-coder-1.5b --param heads=$I20/full-$M --dataset mbpp --limit 5 \
      --max-new-tokens 64 --threads 2 --no-confirm --out $I20/tuned-$M.json
done
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
    --limit 5 --max-new-tokens 64 --out $I20/bench-qwen-64 \
    --methods "autoregressive,hf_generate,hf_assisted,draft_model,$I20/tuned-medusa.json,$I20/tuned-ctc.json"
# fourth pass: the Medusa heads shipped (trees of 4, as tuned), the timed figure at the protocol (128 tokens), then
# `auto` (which now finds the heads) against `auto` without them (a config file: drafters= holds commas)
python benchmarks/ship_draft_heads.py $I20/full-medusa qwen2.5-coder-1.5b-medusa --tree-nodes 4
sed "s#heads/qwen-ctc#$I20/full-ctc#" benchmarks/results/issue20-qwen-tuned-ctc.json > $I20/tuned-ctc.json
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
    --limit 5 --max-new-tokens 128 --out $I20/bench-qwen-128 \
    --methods "autoregressive,hf_generate,hf_assisted,draft_model,medusa,$I20/tuned-ctc.json,auto"
printf '{"format": "speculum-config", "version": 1, "method": "auto", "params": {"drafters": "anpd,prompt_lookup,draft_model"}}' \
    > $I20/auto-no-heads.json
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
    --limit 5 --max-new-tokens 128 --out $I20/bench-qwen-auto-gates \
    --methods "autoregressive,draft_model,medusa,auto,$I20/auto-no-heads.json"
# the rebuilt heads' β on the report sets, bfloat16 as at the second pass (dtype=auto may pick float32 now)
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dtype bfloat16 --dataset humaneval,gsm8k,mt_bench,wmt16 \
    --skip 0 --limit 20 --max-new-tokens 128 --batch 16 --threads 2 \
    --methods "medusa:heads=$I20/full-medusa;ctc:heads=$I20/full-ctc,tree=prefix,top_k=8"
# fifth pass: more distinct prompts (the CTC module overfits). The target's continuations of 510 new texts (one
# layout each), a data pass over them only, then both kinds on the old data plus the new (--extra-data)
NEW="mbpp[200:450],gsm8k[200:400],wmt16[40:100]"  # no report prompt (first 20 per set), no tuning prompt (mbpp[:100])
speculum train medusa --model qwen2.5-coder-1.5b --out $I20/new-data --texts "$NEW" --generate 256 --no-raw-layout \
    --threads 2 --epochs 1 --max-examples 640   # the data (and a throwaway head)
more() { speculum train $1 --model qwen2.5-coder-1.5b --out $I20/more-$2 --texts "$TEXTS" --generate 256 --threads 2 \
    --epochs 2 --max-examples 72000 --data $I20/qwen-ctc/distill_data.safetensors \
    --extra-data $I20/new-data/distill_data.safetensors "${@:3}"; }
more medusa medusa
more ctc-drafter ctc --standardize --lr 3e-4
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dtype bfloat16 --dataset humaneval,gsm8k,mt_bench,wmt16 \
    --skip 0 --limit 20 --max-new-tokens 128 --batch 16 --threads 2 \
    --methods "medusa:heads=$I20/more-medusa;ctc:heads=$I20/more-ctc,tree=prefix,top_k=8"
# Gemma 3 270M, the shipped heads: the paper's tree order against tree=prefix, float32 and bfloat16
python benchmarks/head_acceptance.py --model gemma-3-270m --dataset mbpp --skip 0 --limit 10 --max-new-tokens 64 --threads 2 \
    --methods "ctc;ctc:tree=prefix;ctc:tree=prefix,top_k=8;medusa"
for DT in float32 bfloat16; do
  speculum bench --model gemma-3-270m --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 --limit 5 --max-new-tokens 128 \
      --dtype $DT --out $I20/bench-gemma-$DT --methods "autoregressive,hf_generate,medusa,ctc:tree=first,ctc:tree=prefix"
done

# ---- on a lent GPU (the device tool; nothing fetchable there: carry transformers as a wheel in .whl/):
# the tiny-model tests on CUDA, then t(K) and t(B, K) of published shapes with random weights
# (results/gpu/h100-*.md; BENCHMARKS.md "On a GPU")
bash benchmarks/device_tests.sh 480  # carry [".whl"]; see the script for the wheels
for S in qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b; do
  python benchmarks/verify_cost.py shape:$S --device cuda --dtypes bfloat16 --prepack off --heads all --ks 1,2,4,8,16,32,64 --reps 10
done
for L in 10 20; do  # a 70B does not fit one 80 GB card: slices, cost linear in layers
  python benchmarks/verify_cost.py shape:llama-3-70b --layers $L --device cuda --dtypes bfloat16 --prepack off --heads all \
      --ks 1,2,4,8,16,32,64 --reps 10
done
for S in qwen2.5-1.5b qwen2.5-7b; do
  python benchmarks/batch_cost.py shape:$S --device cuda --dtype bfloat16 --no-prepack --batches 1,2,4,8,16,32 --ks 1,2,4,8,16 --reps 10
done
# twelfth pass: draft_model with and without the controller on the tuning prompts; the transformers rows' repacking
# found slowing the row after them (benchmarks/results/issue18-qwen-greedy-128-v9-hf-order.md), then checked mended
TUNE="--model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset /tmp/mt101-105.jsonl,mbpp --limit 5 --max-new-tokens 64"
speculum bench $TUNE --out $OUT/i18/dm-tuning-greedy-64 --methods "autoregressive,draft_model:controller=false,draft_model:controller=true"
speculum bench $TUNE --temperature 1 --seed 0 --out $OUT/i18/dm-tuning-t1-64 --methods "autoregressive,draft_model:controller=false,draft_model:controller=true"
SPECULUM_DTYPE_MEASURE=refresh python benchmarks/dtype_choice.py --model qwen2.5-coder-1.5b --methods autoregressive --limit 2 \
  --max-new-tokens 64 --threads 2 --out benchmarks/results/issue18-dtype-choice-qwen.json
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench --limit 4 \
  --max-new-tokens 64 --out $OUT/i18/hf-order-check --methods "autoregressive,hf_assisted,draft_model,draft_model:controller=false"
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset wmt16 --limit 5 --max-new-tokens 128 --out $OUT/i18/dm-wmt16-greedy-128 \
  --methods "autoregressive,hf_assisted,draft_model,draft_model:controller=false"
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mt_bench --limit 5 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/dm-mtbench-t1-128 \
  --methods "autoregressive,hf_assisted,draft_model"
# thirteenth pass: dtype="auto" on the Qwen pair with the speculative methods (it picks bfloat16 on this host), then the
# pair's report sets at 128 tokens in the dtype it picks, with the mended benchmark, greedy and T=1
SPECULUM_DTYPE_MEASURE=refresh python benchmarks/dtype_choice.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --methods autoregressive,auto --limit 2 --max-new-tokens 64 --threads 2 --out benchmarks/results/issue18-dtype-choice-qwen-pair.json
Q13="--model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 --limit 5 --max-new-tokens 128"
speculum bench $Q13 --out $OUT/i18/qwen-bf16-greedy-128 --methods "autoregressive,hf_assisted,draft_model,ouroboros,prompt_lookup,anpd,auto"
speculum bench $Q13 --temperature 1 --seed 0 --out $OUT/i18/qwen-bf16-t1-128 --methods "autoregressive,hf_assisted,draft_model,ouroboros,prompt_lookup,anpd,auto"
python benchmarks/controller_bars.py $OUT/i18/qwen-bf16-greedy-128/summary.json; python benchmarks/controller_bars.py $OUT/i18/qwen-bf16-t1-128/summary.json
python benchmarks/verify_cost.py qwen2.5-coder-1.5b --dtypes bfloat16,float32 --prefix 300 --reps 7 --threads 2
# fourteenth pass: bfloat16 prepacked (speculum.accel); stock against prepacked layers in interleaved pairs, the dtype
# chooser again, Gemma end to end in both dtypes, the Qwen pair's report sets greedy in prepacked bfloat16, and
# speculum's plain decoding against transformers' own generate
for M in qwen2.5-coder-1.5b qwen2.5-coder-0.5b gemma-3-270m; do python benchmarks/prepack_ab.py $M --dtype bfloat16 --threads 2; done
SPECULUM_DTYPE_MEASURE=refresh python benchmarks/dtype_choice.py --model gemma-3-270m --methods autoregressive,auto,anpd --limit 5 \
  --threads 2 --out benchmarks/results/issue18-dtype-choice-gemma-14th.json
speculum bench $Q13 --out $OUT/i18/qwen-bf16p-greedy-128 --methods "autoregressive,hf_assisted,draft_model,ouroboros,prompt_lookup,anpd,auto"
python benchmarks/controller_bars.py $OUT/i18/qwen-bf16p-greedy-128/summary.json
speculum bench --model gemma-3-270m --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 --limit 5 --dtype bfloat16 --max-new-tokens 128 \
  --out $OUT/i18/gemma-bf16p-greedy --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
python benchmarks/controller_bars.py $OUT/i18/gemma-bf16p-greedy/summary.json
# fifteenth pass: the controller measures a plain step (plain rounds after 16, 64, then every 256 drafting rounds) and
# times the cost model's sizes interleaved; Gemma greedy and T=1, the Qwen pair at T=1, all in prepacked bfloat16
speculum bench --model gemma-3-270m --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 --limit 5 --dtype bfloat16 --max-new-tokens 128 \
  --out $OUT/i18/gemma-bf16p-greedy-v12 --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
speculum bench --model gemma-3-270m --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 --limit 5 --dtype bfloat16 --max-new-tokens 128 \
  --temperature 1 --seed 0 --out $OUT/i18/gemma-bf16p-t1-v12 --methods "autoregressive,hf_generate,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
speculum bench $Q13 --temperature 1 --seed 0 --out $OUT/i18/qwen-bf16p-t1-128 \
  --methods "autoregressive,hf_generate,hf_assisted,draft_model,ouroboros,prompt_lookup,anpd,auto"
for R in gemma-bf16p-greedy-v12 gemma-bf16p-t1-v12 qwen-bf16p-t1-128; do
  python benchmarks/controller_bars.py $OUT/i18/$R/summary.json
  python benchmarks/round_breakdown.py $OUT/i18/$R
done
# an A/A run: how far two plain-decoding rows of one run differ here (MT-bench, T=1, the target alone)
speculum bench --model qwen2.5-coder-1.5b --threads 2 --dataset mt_bench --limit 5 --max-new-tokens 128 --temperature 1 --seed 0 \
  --out $OUT/i18/qwen-mtbench-t1-aa --methods "autoregressive,autoregressive:controller=false,prompt_lookup,prompt_lookup:controller=false,anpd"
# sixteenth pass: one- and two-token forwards padded to 4 rows where that measures faster (speculum.accel,
# decided at load); bare forwards by size, padded against unpadded end to end in one run, then the Qwen pair
# at T=1 on the two sets where single methods missed, 8 prompts each, beside an A/A row
python benchmarks/row_padding_ab.py --forwards --model qwen2.5-coder-1.5b --rounds 12 --threads 2
python benchmarks/row_padding_ab.py --methods autoregressive,draft_model,ouroboros --sets mt_bench,wmt16 --limit 3 \
  --temperature 1 --threads 2 --out benchmarks/results/issue18-row-padding-ab-t1.json
python benchmarks/row_padding_ab.py --methods autoregressive,draft_model,anpd --sets humaneval,gsm8k --limit 2 \
  --threads 2 --out benchmarks/results/issue18-row-padding-ab-greedy.json
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mt_bench,wmt16 --limit 8 \
  --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-padded-mt-wmt-8 \
  --methods "autoregressive,autoregressive:controller=false,hf_generate,hf_assisted,draft_model,ouroboros,prompt_lookup,anpd,auto"
python benchmarks/controller_bars.py $OUT/i18/qwen-t1-padded-mt-wmt-8/summary.json
python benchmarks/round_breakdown.py $OUT/i18/qwen-t1-padded-mt-wmt-8
# ... and MT-bench again right after (the same prompts and code): how far one 8-prompt run resolves the bar
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mt_bench --limit 8 \
  --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-padded-mt-8-rerun \
  --methods "autoregressive,autoregressive:controller=false,hf_assisted,draft_model,ouroboros,prompt_lookup,auto"
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset wmt16 --limit 8 \
  --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-padded-wmt-8-rerun \
  --methods "autoregressive,autoregressive:controller=false,hf_assisted,draft_model,ouroboros,prompt_lookup,anpd,auto"
# seventeenth pass: a request's first draft only where drafting's saving pays for the draft model's prefill;
# the cost model's first sample of a size smoothed; the bench's method order a balanced Latin square.
# The Qwen pair at T=1 on 40 WMT16 translations (before the new order) and 8 MT-bench questions, then WMT16
# again with the new order
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset wmt16 --limit 40 \
  --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-wmt-40 \
  --methods "autoregressive,autoregressive:controller=false,hf_generate,hf_assisted,draft_model,ouroboros,auto"
python benchmarks/round_breakdown.py $OUT/i18/qwen-t1-wmt-40
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mt_bench --limit 8 \
  --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-t1-mt-8 \
  --methods "autoregressive,autoregressive:controller=false,hf_generate,hf_assisted,draft_model,ouroboros,auto"
python benchmarks/round_breakdown.py $OUT/i18/qwen-t1-mt-8
# 40 WMT16 translations at T=1 with an A/A row, then where the time went and what order did
wmt40_t1() {
  speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset wmt16 --limit 40 \
    --max-new-tokens 128 --temperature 1 --seed 0 --out "$1" \
    --methods "autoregressive,autoregressive:controller=false,hf_generate,hf_assisted,draft_model,ouroboros,auto"
  python benchmarks/round_breakdown.py "$1"
  python benchmarks/order_effects.py "$1"
}
wmt40_t1 $OUT/i18/qwen-t1-wmt-40-latin
# ... and greedy, 12 WMT16 translations: the prefill rule against greedy drafting
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset wmt16 --limit 12 \
  --max-new-tokens 128 --seed 0 --out $OUT/i18/qwen-greedy-wmt-12 \
  --methods "autoregressive,hf_assisted,draft_model,ouroboros,auto"
# eighteenth pass: a long request among short ones expects to run on; a probe that changes nothing doubles the
# wait for the next. WMT16 at T=1 (40 prompts) and greedy (12); Ouroboros' confidence stop for greedy requests,
# chosen on the tuning prompts (/tmp/mt101-105.jsonl as in the ninth pass, and MBPP 1-5), then checked on the
# report sets (the old greedy setting spelled out beside it)
wmt40_t1 $OUT/i18/qwen-t1-wmt-40-p18
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset wmt16 --limit 12 \
  --max-new-tokens 128 --out $OUT/i18/qwen-greedy-wmt-12-p18 --methods "autoregressive,hf_assisted,draft_model,ouroboros,auto"
speculum bench $TUNE --out $OUT/i18/ouro-greedy-policy-tuning --methods "autoregressive,ouroboros:num_speculative_tokens=4,window_size=0,draft_guesses=2,context_phrases=true,ouroboros:num_speculative_tokens=4,window_size=0,draft_guesses=2,context_phrases=true,length_policy=confidence,ouroboros:num_speculative_tokens=4,window_size=0,draft_guesses=1,context_phrases=true,length_policy=confidence"
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --out $OUT/i18/qwen-greedy-128-p18 \
  --methods "autoregressive,hf_assisted,draft_model,ouroboros,ouroboros:num_speculative_tokens=4,window_size=0,draft_guesses=2,context_phrases=true,prompt_lookup,anpd,auto"
python benchmarks/round_breakdown.py $OUT/i18/qwen-greedy-128-p18
python benchmarks/controller_bars.py $OUT/i18/qwen-greedy-128-p18/summary.json
# ... auto's draft-model stop on the tuning prompts (this run also showed the probes starving Ouroboros after
# a switch from chat to code: probes now come by tokens decoded without drafting, not by requests)
speculum bench $TUNE --out $OUT/i18/auto-stop-tuning \
  --methods "autoregressive,ouroboros,auto,auto:draft_confidence=0.4,auto:draft_confidence=0.4,draft_depth=4"
# ... the token-based probes timed on the same tuning prompts
speculum bench $TUNE --out $OUT/i18/probes-tuning --methods "autoregressive,ouroboros,draft_model,auto"
# nineteenth pass: the tokens without drafting counted within a request too (a request that drafted, then stopped,
# probes again); timed on the tuning prompts, then the Qwen pair's report sets greedy at 128 tokens
speculum bench $TUNE --out $OUT/i18/tuning-p19 --methods "autoregressive,ouroboros,draft_model,auto"
python benchmarks/round_breakdown.py $OUT/i18/tuning-p19
# the Qwen pair's report sets, greedy then at T=1 (seed 0), with the round breakdown and the bars: qwen_report_sets PASS
qwen_report_sets() {
  local greedy=$OUT/i18/qwen-bf16-greedy-128-$1 t1=$OUT/i18/qwen-bf16-t1-128-$1
  speculum bench $Q13 --out $greedy --methods "autoregressive,hf_assisted,draft_model,ouroboros,prompt_lookup,anpd,auto"
  python benchmarks/round_breakdown.py $greedy
  python benchmarks/controller_bars.py $greedy/summary.json
  speculum bench $Q13 --temperature 1 --seed 0 --out $t1 \
    --methods "autoregressive,hf_generate,hf_assisted,draft_model,ouroboros,prompt_lookup,anpd,auto"
  python benchmarks/round_breakdown.py $t1
  python benchmarks/controller_bars.py $t1/summary.json
}
qwen_report_sets p19
# ... then, within a request that drafted, only the catch-up weighs a back-off probe (the round is the back-off's):
# timed on the tuning prompts
speculum bench $TUNE --out $OUT/i18/tuning-p19b --methods "autoregressive,ouroboros,draft_model,auto"
python benchmarks/round_breakdown.py $OUT/i18/tuning-p19b
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mt_bench --limit 5 \
  --max-new-tokens 128 --out $OUT/i18/mtbench-greedy-p19b --methods "autoregressive,draft_model,ouroboros,auto"
# twentieth pass: the Qwen pair's report sets again with both catch-up changes, greedy and at T=1
qwen_report_sets p20
# twenty-first pass: the controller's chain stop (a draft model's chain ends where one more draft forward does not
# pay), timed on and off on the tuning prompts with five translations added (WMT16 21-25), then the WMT16 report set.
# The runs named the settings of the code they ran; spelled out here as they are now (naming a parameter of a machine
# setting drops the rest of it: draft_model:confidence_threshold=0.5 had run transformers' heuristic length, 5 tokens)
python - <<'PY'
import json
from speculum.bench.datasets import load_dataset
with open("/tmp/wmt21-25.jsonl", "w") as f:
    for p in load_dataset("wmt16")[20:25]:
        f.write(json.dumps({"question_id": p.question_id, "turns": [p.text]}) + "\n")
PY
TUNE21="--model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset /tmp/mt101-105.jsonl,mbpp,/tmp/wmt21-25.jsonl --limit 5 --max-new-tokens 64"
DM08="draft_model:length_policy=confidence,num_speculative_tokens=20,confidence_threshold=0.8"
DM_OLD="$DM08,chain_stop=false"  # the old CPU default
DM_HEUR="draft_model:length_policy=heuristic,num_speculative_tokens=5"
OURO04="ouroboros:num_speculative_tokens=4,window_size=0,draft_guesses=1,context_phrases=true,length_policy=confidence,confidence_threshold=0.4"
OURO_OLD="$OURO04,chain_stop=false"  # the old CPU default
# run 1: the stop on and off at the old thresholds
speculum bench $TUNE21 --out $OUT/i18/tuning-p21 --methods "autoregressive,$DM08,$DM_OLD,$OURO04,$OURO_OLD,auto:chain_stop=true,auto"
python benchmarks/round_breakdown.py $OUT/i18/tuning-p21
# run 2: permissive thresholds with the stop (draft_model: the heuristic length), and without
speculum bench $TUNE21 --out $OUT/i18/tuning-p21b \
  --methods "autoregressive,$DM_OLD,$DM_HEUR,$DM_HEUR,chain_stop=false,$OURO_OLD,ouroboros,auto,auto:draft_confidence=0.5,chain_stop=true"
python benchmarks/round_breakdown.py $OUT/i18/tuning-p21b
# run 3, T = 1: the candidates (now the defaults: draft_model 0.5, Ouroboros 0.2, both with the stop) and the old
speculum bench $TUNE21 --temperature 1 --seed 0 --out $OUT/i18/tuning-t1-p21 \
  --methods "autoregressive,$DM_OLD,draft_model,$OURO_OLD,ouroboros,auto,auto:draft_confidence=0.5,chain_stop=true"
python benchmarks/round_breakdown.py $OUT/i18/tuning-t1-p21
# run 4: the new defaults against the old, greedy
speculum bench $TUNE21 --out $OUT/i18/tuning-p21c --methods "autoregressive,draft_model,$DM_OLD,ouroboros,$OURO_OLD"
python benchmarks/round_breakdown.py $OUT/i18/tuning-p21c
# the WMT16 report set greedy at 128 tokens, old and new beside prompt lookup and auto
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset wmt16 --limit 5 \
  --max-new-tokens 128 --out $OUT/i18/wmt-greedy-p21 --methods "autoregressive,prompt_lookup,draft_model,$DM_OLD,ouroboros,$OURO_OLD,auto"
python benchmarks/round_breakdown.py $OUT/i18/wmt-greedy-p21
# ---- issue #20, sixth pass (started): both data files rebuilt under heads/ (the fifth pass's commands, into
# heads/qwen-medusa and heads/qwen-new), then the CTC module on both with a longer budget (4 x 75,000 examples,
# a checkpoint per epoch: the same command with --resume continues), then β against Medusa on the same data
speculum train ctc-drafter --model qwen2.5-coder-1.5b --out heads/qwen-ctc-long --texts "$TEXTS" --generate 256 \
    --data heads/qwen-medusa/distill_data.safetensors --extra-data heads/qwen-new/distill_data.safetensors \
    --standardize --lr 3e-4 --epochs 4 --max-examples 75000 --threads 2
# (done in the sixth pass: the 360-prompt data only, the fourth pass's recipe retrained in float32 on an Xeon without
# native bf16, then β at 16 and 63 nodes on tuning prompts: neither report (the first 20) nor training prompts)
speculum train ctc-drafter --model qwen2.5-coder-1.5b --out heads/qwen-ctc --texts "$TEXTS" --generate 256 \
    --data heads/qwen-medusa/distill_data.safetensors --standardize --lr 3e-4 --epochs 2 --max-examples 72000 --threads 2
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dataset mbpp,humaneval,gsm8k,wmt16 --skip 20 --limit 6 \
  --max-new-tokens 128 --batch 12 --threads 2 \
  --methods "medusa:tree_nodes=16;medusa:tree_nodes=63;ctc:heads=heads/qwen-ctc,tree=prefix,top_k=8,tree_nodes=16;ctc:heads=heads/qwen-ctc,tree=prefix,top_k=8,tree_nodes=63;ctc:heads=heads/qwen-ctc,tree=prefix,top_k=16,tree_nodes=63"
# (started, next pass: the paper's regulariser, --noise 0.2, same data and budget; then its β as above)
speculum train ctc-drafter --model qwen2.5-coder-1.5b --out heads/qwen-ctc-noise --texts "$TEXTS" --generate 256 \
    --data heads/qwen-medusa/distill_data.safetensors --standardize --lr 3e-4 --epochs 2 --max-examples 72000 --threads 2 \
    --noise 0.2
# ---- issue #18, twenty-second pass: an AVX2-only host (dtype="auto" gives prepacked float32): both models' report
# sets greedy at 128 tokens; then lookahead alone greedy and at T = 1 with commit e84f173 (its windows verified whole or
# not at all; reverted by 2037a03: see BENCHMARKS.md); then what a chain and a tree of n nodes cost
G22="--model gemma-3-270m --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 --limit 5 --max-new-tokens 128"
speculum bench $G22 --out $OUT/i18/gemma-avx2-greedy-p22 \
  --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
python benchmarks/controller_bars.py $OUT/i18/gemma-avx2-greedy-p22/summary.json
speculum bench $Q13 --out $OUT/i18/qwen-avx2-greedy-128-p22 --methods "autoregressive,hf_assisted,prompt_lookup,anpd,draft_model,ouroboros,auto"
python benchmarks/round_breakdown.py $OUT/i18/qwen-avx2-greedy-128-p22
python benchmarks/controller_bars.py $OUT/i18/qwen-avx2-greedy-128-p22/summary.json
speculum bench $G22 --out $OUT/i18/gemma-avx2-greedy-lookahead-p22 --methods "autoregressive,lookahead"
speculum bench $G22 --temperature 1 --seed 0 --out $OUT/i18/gemma-avx2-t1-lookahead-p22 --methods "autoregressive,lookahead"
python benchmarks/chain_vs_tree.py gemma-3-270m
python benchmarks/chain_vs_tree.py qwen2.5-coder-1.5b --sizes 1,2,4,8,16 --reps 5
# ... and Gemma 3 270M's report sets at T = 1 with the shipped code
speculum bench $G22 --temperature 1 --seed 0 --out $OUT/i18/gemma-avx2-t1-p22 \
  --methods "autoregressive,hf_generate,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
python benchmarks/controller_bars.py $OUT/i18/gemma-avx2-t1-p22/summary.json
# ... and auto's draft-model depth as a lead, on the tuning prompts (MT-bench 101-105, WMT16 21-25; files as above)
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset /tmp/mt101-105.jsonl,/tmp/wmt21-25.jsonl \
  --limit 5 --max-new-tokens 64 --out $OUT/i18/auto-lead-tuning-p22 --methods "autoregressive,draft_model,auto,auto:draft_confidence=0.5,chain_stop=true"
# ---- issue #18, twenty-third pass (AVX2 host, float32): the calibration's per-drafter correction (controller.Calibration
# .by_source). The trace that found it, then the Qwen pair's chat and translation sets, Gemma 3 270M's report sets,
# and the Qwen pair's code sets
python benchmarks/trace_rounds.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --methods "autoregressive;auto;draft_model" --dataset mt_bench --limit 5 --out $OUT/i18/trace-mt-p23.jsonl
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mt_bench,wmt16 --limit 5 \
  --max-new-tokens 128 --out $OUT/i18/qwen-avx2-chat-p23 --methods "autoregressive,hf_assisted,anpd,draft_model,ouroboros,auto"
python benchmarks/round_breakdown.py $OUT/i18/qwen-avx2-chat-p23
speculum bench $G22 --out $OUT/i18/gemma-avx2-greedy-p23 \
  --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
python benchmarks/controller_bars.py $OUT/i18/gemma-avx2-greedy-p23/summary.json
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k --limit 5 \
  --max-new-tokens 128 --out $OUT/i18/qwen-avx2-code-p23 --methods "autoregressive,hf_assisted,draft_model,ouroboros,auto"
speculum bench $G22 --temperature 1 --seed 0 --out $OUT/i18/gemma-avx2-t1-p23 \
  --methods "autoregressive,hf_generate,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
python benchmarks/controller_bars.py $OUT/i18/gemma-avx2-t1-p23/summary.json
# ---- issue #18, twenty-fourth pass (AVX2 host, float32): machine classes; lookahead tuned on the tuning prompts
# (MBPP 1-5, MT-bench 101-105 and WMT16 21-25 as /tmp/mt101-105.jsonl and /tmp/wmt21-25.jsonl, see above), then its
# report sets greedy and at T=1 with the old setting beside it; auto's draft-model stop re-checked; the Qwen pair at T=1
speculum bench --model gemma-3-270m --threads 2 --dataset mbpp,/tmp/mt101-105.jsonl,/tmp/wmt21-25.jsonl --limit 5 \
  --max-new-tokens 128 --out $OUT/i18/gemma-avx2-lookahead-tuning-p24 --methods "autoregressive,lookahead,\
lookahead:window_size=3,ngram_size=3,guess_set_size=3,lookahead:window_size=2,ngram_size=4,guess_set_size=4,\
lookahead:window_size=4,ngram_size=4,guess_set_size=4,pool_from_prompt=true,\
lookahead:window_size=3,ngram_size=3,guess_set_size=3,pool_from_prompt=true"
speculum bench --model gemma-3-270m --threads 2 --dataset mbpp,/tmp/mt101-105.jsonl,/tmp/wmt21-25.jsonl --limit 5 \
  --max-new-tokens 128 --out $OUT/i18/gemma-avx2-lookahead-tuning2-p24 --methods "autoregressive,\
lookahead:window_size=3,ngram_size=3,guess_set_size=3,pool_from_prompt=true,\
lookahead:window_size=2,ngram_size=4,guess_set_size=4,pool_from_prompt=true,\
lookahead:window_size=2,ngram_size=3,guess_set_size=3,pool_from_prompt=true,\
lookahead:window_size=2,ngram_size=4,guess_set_size=2,pool_from_prompt=true,\
lookahead:window_size=1,ngram_size=4,guess_set_size=4,pool_from_prompt=true"
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset /tmp/mt101-105.jsonl,/tmp/wmt21-25.jsonl,mbpp \
  --limit 5 --max-new-tokens 64 --out $OUT/i18/qwen-avx2-auto-tuning-p24 \
  --methods "autoregressive,draft_model,auto,auto:draft_confidence=0.5,chain_stop=true,auto:draft_confidence=0.5"
speculum bench $G22 --out $OUT/i18/gemma-avx2-greedy-lookahead-p24 \
  --methods "autoregressive,hf_generate,lookahead,lookahead:window_size=4,ngram_size=4,guess_set_size=4"
speculum bench $G22 --temperature 1 --seed 0 --out $OUT/i18/gemma-avx2-t1-lookahead-p24 \
  --methods "autoregressive,hf_generate,lookahead,lookahead:window_size=4,ngram_size=4,guess_set_size=4"
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mt_bench,wmt16 --limit 5 \
  --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-avx2-t1-chat-p24 \
  --methods "autoregressive,hf_assisted,draft_model,ouroboros,auto"
python benchmarks/trace_rounds.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --methods "autoregressive;auto;draft_model" --dataset mt_bench --limit 5 --temperature 1 --seed 0 --out $OUT/i18/trace-mt-t1-p24.jsonl
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset /tmp/mt101-105.jsonl,/tmp/wmt21-25.jsonl \
  --limit 5 --max-new-tokens 64 --temperature 1 --seed 0 --out $OUT/i18/qwen-avx2-auto-tuning-t1-p24 \
  --methods "autoregressive,draft_model,auto,auto:draft_confidence=0.5,chain_stop=true"
# ---- issue #18, twenty-fifth pass (float32): a sampled round of auto that runs the draft model verifies
# its draft alone; the tuning prompts at T=1 (auto with Ouroboros as its draft-model part, and with draft_model), then
# the Qwen pair's four report sets at T=1. The tuning run was made on the AVX2 host (its output lost with the
# machine), then both on an AVX-512 host without bf16, as qwen-avx512-auto-tuning-t1-p25 and qwen-avx512-t1-p25,
# the report sets first
printf '{"format": "speculum-config", "version": 1, "method": "auto", "params": {"drafters": "anpd,prompt_lookup,medusa,draft_model"}}' \
    > $OUT/i18/auto-dm.json
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset /tmp/mt101-105.jsonl,/tmp/wmt21-25.jsonl,mbpp \
  --limit 5 --max-new-tokens 64 --temperature 1 --seed 0 --out $OUT/i18/qwen-avx2-auto-tuning-t1-p25 \
  --methods "autoregressive,draft_model,auto,$OUT/i18/auto-dm.json"
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-avx2-t1-p25 \
  --methods "autoregressive,hf_assisted,draft_model,ouroboros,auto"
# the catch-up rule on a longer memory (auto's gates): the chat and translation report sets at T=1 again
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-avx512-t1-chat-p25b \
  --methods "autoregressive,draft_model,auto"
# ... and draft_model with the controller's catch-up rule on the longer memory too
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-avx512-t1-chat-p25c \
  --methods "autoregressive,draft_model"
# ---- issue #18, twenty-sixth pass (float32, the AVX-512 Xeon without bf16): both changes of the twenty-fifth pass
# (a sampled draft-model round verifies its draft alone; the catch-up rule on a longer memory), every method on the
# Qwen pair's four report sets, T=1 then greedy; then what a verification costs with stock and prepacked float32
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-avx512-t1-p26 \
  --methods "autoregressive,hf_assisted,draft_model,ouroboros,auto"
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --out $OUT/i18/qwen-avx512-greedy-p26 \
  --methods "autoregressive,hf_generate,hf_assisted,prompt_lookup,anpd,draft_model,ouroboros,auto"
# (stopped after four HumanEval prompts: transformers' plain generate ran 1.42x speculum's plain decoding), then
python benchmarks/verify_cost.py qwen2.5-coder-1.5b --dtypes float32 --ks 1,2,4,8,16 --reps 5 --threads 2 --prefix 300
python benchmarks/verify_cost.py qwen2.5-coder-0.5b --dtypes float32 --ks 1,2,4,8 --reps 5 --threads 2 --prefix 300
# after the change (one- and two-token forwards on the stock kernel where it measures faster), greedy, two sets
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,mt_bench \
  --limit 2 --max-new-tokens 128 --out $OUT/i18/qwen-avx512-greedy-dense-p26 \
  --methods "autoregressive,hf_generate,hf_assisted,draft_model,ouroboros,auto"
python benchmarks/plain_gap.py qwen2.5-coder-1.5b --tokens 48 --rounds 2
# ... and the chat and translation sets at T=1 with the stock kernel for small forwards
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-avx512-t1-chat-dense-p26 \
  --methods "autoregressive,hf_generate,draft_model,ouroboros,auto"
# ---- issue #18, twenty-seventh pass (float32, the AVX-512 Xeon without bf16, one- and two-token forwards on the
# stock kernel): every method on the Qwen pair's four report sets greedy; then auto's draft-model part on the tuning
# prompts (MT-bench 101-105, WMT16 21-25 as above, MBPP 1-5; 64 tokens)
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --out $OUT/i18/qwen-avx512-greedy-p27 \
  --methods "autoregressive,hf_generate,hf_assisted,prompt_lookup,anpd,draft_model,ouroboros,auto"
python benchmarks/controller_bars.py $OUT/i18/qwen-avx512-greedy-p27/summary.json
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset /tmp/mt101-105.jsonl,/tmp/wmt21-25.jsonl,mbpp \
  --limit 5 --max-new-tokens 64 --out $OUT/i18/qwen-avx512-auto-tuning-p27 \
  --methods "autoregressive,draft_model,auto,auto:draft_confidence=0.5,chain_stop=true,$OUT/i18/auto-dm.json"
# Gemma 3 270M on the same host, greedy, then lookahead's two CPU settings on the tuning prompts
speculum bench $G22 --out $OUT/i18/gemma-avx512-greedy-p27 \
  --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
python benchmarks/controller_bars.py $OUT/i18/gemma-avx512-greedy-p27/summary.json
speculum bench --model gemma-3-270m --threads 2 --dataset mbpp,/tmp/mt101-105.jsonl,/tmp/wmt21-25.jsonl --limit 5 \
  --max-new-tokens 128 --out $OUT/i18/gemma-avx512-lookahead-tuning-p27 \
  --methods "autoregressive,lookahead,lookahead:window_size=1,ngram_size=4,guess_set_size=4,pool_from_prompt=true"
# ---- issue #18, twenty-eighth pass (the same Xeon; Gemma's cost curve measured afresh: rm ~/.cache/speculum/costs/*
# if one was cached while the machine was busy, or let three forwards rescale it): Gemma greedy, every method; the
# heads on prepacked matrices; Gemma at T = 1
speculum bench $G22 --out $OUT/i18/gemma-avx512-greedy-p28 \
  --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
speculum bench $G22 --out $OUT/i18/gemma-avx512-heads-p28 --methods "autoregressive,medusa,ctc,auto"
speculum bench $G22 --temperature 1 --seed 0 --out $OUT/i18/gemma-avx512-t1-p28 \
  --methods "autoregressive,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
python benchmarks/controller_bars.py $OUT/i18/gemma-avx512-t1-p28/summary.json
# ---- issue #18, twenty-ninth pass (the same Xeon): a noise floor in the run (autoregressive#2, plain decoding again);
# Gemma at T = 1, every method; the Qwen pair at T = 1 on HumanEval and GSM8K with the stock kernel for small forwards
speculum bench $G22 --temperature 1 --seed 0 --out $OUT/i18/gemma-avx512-t1-aa-p29 \
  --methods "autoregressive,autoregressive#2,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
python benchmarks/controller_bars.py $OUT/i18/gemma-avx512-t1-aa-p29/summary.json
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k \
  --limit 5 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-avx512-t1-code-p29 \
  --methods "autoregressive,autoregressive#2,hf_generate,hf_assisted,draft_model,ouroboros,auto"
# one-round probes once probes lose (not kept; branch wip/scout-probes): the tuning prompts at T = 1, the current code
# (A) then the branch (B), each run with its own plain row
speculum bench --model gemma-3-270m --threads 2 --dataset mbpp,/tmp/mt101-105.jsonl,/tmp/wmt21-25.jsonl --limit 5 \
  --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/gemma-tuning-t1-scout-A --methods "autoregressive,medusa,ctc,auto"
# ... and the branch (B): git worktree add /tmp/wt wip/scout-probes, then the same command with PYTHONPATH=/tmp/wt/src
# and --out $OUT/i18/gemma-tuning-t1-scout-B
# ---- issue #18, thirtieth pass (the same Xeon): a round that verifies nothing measures a plain step (881fe4b), then
# auto's controller judging asking by the better of a round as it ran and as it would have run without its gated parts
# (lean rounds). Run 1: the lean rule's first version (lean rounds with nothing proposed counted), with ctc;
# run 2: the rule as committed
speculum bench $G22 --temperature 1 --seed 0 --out $OUT/i18/gemma-avx512-t1-lean-p30 \
  --methods "autoregressive,autoregressive#2,hf_generate,hf_prompt_lookup,anpd,ctc,auto"
speculum bench $G22 --temperature 1 --seed 0 --out $OUT/i18/gemma-avx512-t1-lean2-p30 \
  --methods "autoregressive,autoregressive#2,hf_generate,hf_prompt_lookup,anpd,auto"
# ---- issue #18, thirty-first pass (the same Xeon): a lean round counts the cheap drafters' nodes verified (4fb68be);
# the Qwen pair at T = 1 on MT-bench and WMT16 with the stock kernel for small forwards and auto's lean judgement
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-avx512-t1-chat-p31 \
  --methods "autoregressive,autoregressive#2,hf_generate,hf_assisted,draft_model,ouroboros,auto"
python benchmarks/controller_bars.py $OUT/i18/qwen-avx512-t1-chat-p31/summary.json
# the interleaved trace that found auto backing off after exploring (Gemma, T = 1, report sets; not a timed figure)
python benchmarks/trace_rounds.py --methods "autoregressive;anpd;auto" --dataset humaneval,gsm8k,mt_bench --limit 5 \
  --temperature 1 --seed 0 --out $OUT/i18/trace-gemma-t1-interleaved-p31.jsonl
# an explored round judged as its plan would have gone (f1e9026): the tuning prompts at T = 1, the code before (A, from a
# worktree of 840675a: PYTHONPATH=/tmp/wt-old/src) and after (B), each run with its own plain row
T31="--model gemma-3-270m --threads 2 --dataset mbpp,/tmp/mt101-105.jsonl,/tmp/wmt21-25.jsonl --limit 5 --max-new-tokens 128 --temperature 1 --seed 0"
PYTHONPATH=/tmp/wt-old/src speculum bench $T31 --methods autoregressive,anpd,auto --out $OUT/i18/gemma-tuning-t1-explore-A-p31
speculum bench $T31 --methods autoregressive,anpd,auto --out $OUT/i18/gemma-tuning-t1-explore-B-p31
# ---- issue #18, thirty-second pass (the same Xeon): Gemma 3 270M's report sets at T = 1, every method, with f1e9026;
# then a sampled request probing at once while keeping the carried back-off's length (branch wip/probe-each-request,
# worktree /tmp/wt-probe), A against B on the tuning prompts, each run with its own plain row
speculum bench $G22 --temperature 1 --seed 0 --out $OUT/i18/gemma-avx512-t1-p32 \
  --methods "autoregressive,autoregressive#2,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
python benchmarks/controller_bars.py $OUT/i18/gemma-avx512-t1-p32/summary.json
speculum bench $T31 --methods autoregressive,anpd,auto --out $OUT/i18/gemma-tuning-t1-probe-A-p32
PYTHONPATH=/tmp/wt-probe/src speculum bench $T31 --methods autoregressive,anpd,auto --out $OUT/i18/gemma-tuning-t1-probe-B-p32  # results/issue18-gemma-tuning-t1-probe-{A,B}-p32.md
# ---- issue #18, thirty-third pass: back on an AVX-512-bf16 AMD EPYC (dtype="auto" -> bfloat16, prepacked), the code
# of the thirty-second pass: both models' report sets greedy and at T = 1, every method, in one session
speculum bench $G22 --out $OUT/i18/gemma-bf16-greedy-p33 \
  --methods "autoregressive,autoregressive#2,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
python benchmarks/controller_bars.py $OUT/i18/gemma-bf16-greedy-p33/summary.json
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --out $OUT/i18/qwen-bf16-greedy-p33 \
  --methods "autoregressive,autoregressive#2,hf_generate,hf_assisted,prompt_lookup,anpd,draft_model,ouroboros,auto"
speculum bench $G22 --temperature 1 --seed 0 --out $OUT/i18/gemma-bf16-t1-p33 \
  --methods "autoregressive,autoregressive#2,hf_generate,hf_prompt_lookup,anpd,prompt_lookup,lookahead,medusa,ctc,auto"
speculum bench --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --limit 5 --max-new-tokens 128 --temperature 1 --seed 0 --out $OUT/i18/qwen-bf16-t1-p33 \
  --methods "autoregressive,hf_generate,hf_assisted,draft_model,ouroboros,auto"  # no second plain row: it did not fit the session
# lookahead's two CPU settings on the tuning prompts on this class (the files made as in the ninth and twenty-first
# passes above: /tmp/mt101-105.jsonl = MT-bench 101-105, /tmp/wmt21-25.jsonl = WMT16 21-25), greedy and at T = 1
T33="--model gemma-3-270m --threads 2 --dataset mbpp,/tmp/mt101-105.jsonl,/tmp/wmt21-25.jsonl --limit 5 --max-new-tokens 128"
speculum bench $T33 --out $OUT/i18/gemma-bf16-lookahead-tuning-p33 \
  --methods "autoregressive,lookahead,lookahead:window_size=1,ngram_size=4,guess_set_size=4,pool_from_prompt=true"
speculum bench $T33 --temperature 1 --seed 0 --out $OUT/i18/gemma-bf16-lookahead-tuning-t1-p33 \
  --methods "autoregressive,lookahead,lookahead:window_size=1,ngram_size=4,guess_set_size=4,pool_from_prompt=true"
# lookahead with its new CPU setting (one column, c8a7735) on the report sets, greedy and at T = 1
speculum bench $G22 --out $OUT/i18/gemma-bf16-lookahead-report-p33 --methods "autoregressive,autoregressive#2,lookahead"
speculum bench $G22 --temperature 1 --seed 0 --out $OUT/i18/gemma-bf16-lookahead-report-t1-p33 \
  --methods "autoregressive,autoregressive#2,lookahead"
# ---- issue #20, seventh pass (AVX-512-bf16 EPYC): the 360-prompt data rebuilt from the committed continuations straight
# into heads/qwen-ctc by the CTC trainer, the fourth pass's module as the control, then two levers on the same data and
# budget (the paper's noise; the released code's 6 frames and 3-token labels), β on the tuning prompts
T="mbpp[100:200],gsm8k[100:200],wmt16[100:200],mt_bench[20:]"
mkdir -p heads/qwen-ctc && cp benchmarks/data/qwen2.5-coder-1.5b-continuations.jsonl heads/qwen-ctc/continuations.jsonl
speculum train ctc-drafter --model qwen2.5-coder-1.5b --out heads/qwen-ctc --texts "$T" --generate 256 \
  --standardize --lr 3e-4 --epochs 2 --max-examples 72000 --threads 2
speculum train ctc-drafter --model qwen2.5-coder-1.5b --out heads/qwen-ctc-noise --texts "$T" --generate 256 \
  --data heads/qwen-ctc/distill_data.safetensors --standardize --lr 3e-4 --epochs 2 --max-examples 72000 --threads 2 --noise 0.2
speculum train ctc-drafter --model qwen2.5-coder-1.5b --out heads/qwen-ctc-s6l3 --texts "$T" --generate 256 \
  --data heads/qwen-ctc/distill_data.safetensors --standardize --lr 3e-4 --epochs 2 --max-examples 72000 --threads 2 \
  --slots 6 --label-length 3
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dataset mbpp,humaneval,gsm8k,wmt16 --skip 20 --limit 6 \
  --max-new-tokens 128 --batch 12 --threads 2 \
  --methods "medusa:tree_nodes=16;ctc:heads=heads/qwen-ctc,tree=prefix,top_k=8,tree_nodes=16;ctc:heads=heads/qwen-ctc-noise,tree=prefix,top_k=8,tree_nodes=16"
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dataset mbpp,humaneval,gsm8k,wmt16 --skip 20 --limit 6 \
  --max-new-tokens 128 --batch 12 --threads 2 \
  --methods "ctc:heads=heads/qwen-ctc-s6l3,tree=prefix,top_k=8,tree_nodes=16;ctc:heads=heads/qwen-ctc,tree=prefix,top_k=8,tree_nodes=16"
# ---- issue #20, eighth pass (AVX-512-bf16 EPYC): the refining second pass (--refine) against the seventh pass's
# control, same data and budget; then the control's recipe on the 360 + 510-prompt data with a longer budget
# (2 x 128,000 examples against 2 x 72,000), β on the tuning prompts and on the report sets
speculum train ctc-drafter --model qwen2.5-coder-1.5b --out heads/qwen-ctc-refine --texts "$T" --generate 256 \
  --data heads/qwen-ctc/distill_data.safetensors --standardize --lr 3e-4 --epochs 2 --max-examples 72000 --threads 2 --refine
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dataset mbpp,humaneval,gsm8k,wmt16 --skip 20 --limit 6 \
  --max-new-tokens 128 --batch 12 --threads 2 \
  --methods "ctc:heads=heads/qwen-ctc-refine,tree=prefix,top_k=8,tree_nodes=16;ctc:heads=heads/qwen-ctc,tree=prefix,top_k=8,tree_nodes=16"
speculum train ctc-drafter --model qwen2.5-coder-1.5b --out heads/qwen-ctc-both-long --texts "$T" --generate 256 \
  --data heads/qwen-ctc/distill_data.safetensors --extra-data heads/qwen-new/distill_data.safetensors \
  --standardize --lr 3e-4 --epochs 2 --max-examples 128000 --threads 2
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dataset mbpp,humaneval,gsm8k,wmt16 --skip 20 --limit 6 \
  --max-new-tokens 128 --batch 12 --threads 2 --methods "ctc:heads=heads/qwen-ctc-both-long,tree=prefix,top_k=8,tree_nodes=16"
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dtype bfloat16 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --skip 0 --limit 20 --max-new-tokens 128 --batch 16 --threads 2 --methods "medusa;ctc:heads=heads/qwen-ctc-both-long,tree=prefix,top_k=8"
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dtype bfloat16 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --skip 0 --limit 20 --max-new-tokens 128 --batch 16 --threads 2 --methods "medusa:tree_nodes=16"
# ---- issue #20, ninth pass (AVX-512-bf16 EPYC): prompts of the report sets' kinds without their prompts: chat
# questions the target writes itself (MT-bench's eight categories) and HumanEval's problems 27-164; their continuations
# and data pass, then the eighth pass's recipe on all three data files; β on the tuning prompts and the report sets
python benchmarks/make_chat_questions.py --threads 2 --out benchmarks/data/qwen2.5-coder-1.5b-chat-questions.jsonl
mkdir -p heads/qwen-ctc-kinds && cp benchmarks/data/qwen2.5-coder-1.5b-continuations-kinds.jsonl heads/qwen-ctc-kinds/continuations.jsonl
speculum train ctc-drafter --model qwen2.5-coder-1.5b --out heads/qwen-ctc-kinds \
  --texts "humaneval[26:],benchmarks/data/qwen2.5-coder-1.5b-chat-questions.jsonl" --generate 256 --no-raw-layout \
  --extra-data heads/qwen-ctc/distill_data.safetensors --extra-data heads/qwen-new/distill_data.safetensors \
  --standardize --lr 3e-4 --epochs 2 --max-examples 128000 --threads 2
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dtype bfloat16 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --skip 0 --limit 20 --max-new-tokens 128 --batch 16 --threads 2 --methods "ctc:heads=heads/qwen-ctc-kinds,tree=prefix,top_k=8"
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dataset mbpp,humaneval,gsm8k,wmt16 --skip 20 --limit 6 \
  --max-new-tokens 128 --batch 12 --threads 2 --methods "ctc:heads=heads/qwen-ctc-kinds,tree=prefix,top_k=8,tree_nodes=16"
speculum train medusa --model qwen2.5-coder-1.5b --out heads/qwen-medusa-kinds --texts "humaneval[26:],benchmarks/data/qwen2.5-coder-1.5b-chat-questions.jsonl" --generate 256 --no-raw-layout \
  --data heads/qwen-ctc-kinds/distill_data.safetensors --extra-data heads/qwen-ctc/distill_data.safetensors \
  --extra-data heads/qwen-new/distill_data.safetensors --epochs 2 --max-examples 72000 --threads 2   # Medusa on the same data
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dtype bfloat16 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --skip 0 --limit 20 --max-new-tokens 128 --batch 16 --threads 2 --methods "medusa:heads=heads/qwen-medusa-kinds,tree_nodes=16"
# ---- issue #20, tenth pass (same host): the ninth pass's data and recipe with a window of 64 hidden states; chosen on
# the tuning prompts (top_k 6 and 12 replayed there too), then replayed once on the report sets
mkdir -p heads/qwen-ctc-ctx64 && cp heads/qwen-ctc-kinds/continuations.jsonl heads/qwen-ctc-ctx64/
speculum train ctc-drafter --model qwen2.5-coder-1.5b --out heads/qwen-ctc-ctx64 \
  --texts "humaneval[26:],benchmarks/data/qwen2.5-coder-1.5b-chat-questions.jsonl" --generate 256 --no-raw-layout \
  --data heads/qwen-ctc-kinds/distill_data.safetensors --extra-data heads/qwen-ctc/distill_data.safetensors \
  --extra-data heads/qwen-new/distill_data.safetensors --standardize --lr 3e-4 --epochs 2 --max-examples 128000 \
  --threads 2 --context 64
for k in 8 6 12; do
  python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dataset mbpp,humaneval,gsm8k,wmt16 --skip 20 --limit 6 \
    --max-new-tokens 128 --batch 12 --threads 2 --methods "ctc:heads=heads/qwen-ctc-ctx64,tree=prefix,top_k=$k,tree_nodes=16"
done
python benchmarks/head_acceptance.py --model qwen2.5-coder-1.5b --dtype bfloat16 --dataset humaneval,gsm8k,mt_bench,wmt16 \
  --skip 0 --limit 20 --max-new-tokens 128 --batch 16 --threads 2 --methods "ctc:heads=heads/qwen-ctc-ctx64,tree=prefix,top_k=8"
speculum bench --model qwen2.5-coder-1.5b --threads 2 --dataset humaneval,gsm8k --limit 5 --max-new-tokens 128 \
  --out $OUT/i20/bench-ctx64 --methods "autoregressive,hf_generate,ctc:heads=heads/qwen-ctc-ctx64,tree=prefix,tree_nodes=4"
speculum bench --model qwen2.5-coder-1.5b --threads 2 --dtype float32 --dataset gsm8k --limit 4 --max-new-tokens 128 --warmup 0 \
  --out $OUT/i20/f32-check --methods "autoregressive,ctc:heads=heads/qwen-ctc-ctx64,tree=prefix,tree_nodes=4"
# ---- issue #18, thirty-fourth pass (AVX-512-bf16 EPYC, bfloat16): is auto's gap to the draft-model methods on the
# report sets' MT-bench (writing questions 81-85) and WMT16 there on held-out prompts of the same kinds? The files:
# MT-bench 101-112 (reasoning, math: the old tuning kind), 86-97 (writing, roleplay), WMT16 21-32, MBPP 1-6
python - <<'PY'
import json
from speculum.bench.datasets import load_dataset
def write(path, prompts):
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"question_id": p.question_id, "turns": [p.text]}) + "\n")
write("/tmp/mt101-112.jsonl", load_dataset("mt_bench")[20:32])
write("/tmp/mt86-97.jsonl", load_dataset("mt_bench")[5:17])
write("/tmp/wmt21-32.jsonl", load_dataset("wmt16")[20:32])
write("/tmp/mbpp1-6.jsonl", load_dataset("mbpp")[:6])
PY
QWEN="--model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --threads 2 --max-new-tokens 128"
speculum bench $QWEN --dataset /tmp/mt101-112.jsonl,/tmp/wmt21-32.jsonl --limit 12 --out $OUT/i18/qwen-bf16-chat-tuning-p34 \
  --methods "autoregressive,autoregressive#2,draft_model,ouroboros,auto,benchmarks/results/auto-heads-ouroboros.json,benchmarks/results/auto-draft-model-medusa.json"
speculum bench $QWEN --dataset /tmp/mt86-97.jsonl --limit 12 --out $OUT/i18/qwen-bf16-writing-tuning-p34 \
  --methods "autoregressive,autoregressive#2,draft_model,ouroboros,auto,benchmarks/results/auto-heads-ouroboros.json,auto:draft_confidence=0.5,auto:draft_confidence=0.5,chain_stop=true#stop"
speculum bench $QWEN --dataset /tmp/mt86-97.jsonl,/tmp/mbpp1-6.jsonl --limit 12 --out $OUT/i18/qwen-bf16-chain-tuning-p34 \
  --methods "autoregressive,autoregressive#2,ouroboros,auto,auto:draft_confidence=0.2,chain_stop=true#ouro-chain,auto:draft_confidence=0.6#c06"
# the option tried and reverted (the chain stop bypassed after a token the draft is sure of; the patch holds its tests):
# these two run from a worktree with benchmarks/results/issue18-p34-chain-stop-below.patch applied
git worktree add /tmp/wt-sure 276ead0 && git -C /tmp/wt-sure apply "$PWD/benchmarks/results/issue18-p34-chain-stop-below.patch"
PYTHONPATH=/tmp/wt-sure/src speculum bench $QWEN --dataset /tmp/mt86-97.jsonl,/tmp/mbpp1-6.jsonl --limit 12 --out $OUT/i18/qwen-bf16-hybrid-tuning-p34 \
  --methods "autoregressive,autoregressive#2,ouroboros,auto,auto:draft_confidence=0.2,chain_stop=true,chain_stop_below=0.8#hybrid"
OURO="ouroboros:num_speculative_tokens=4,window_size=0,draft_guesses=1,context_phrases=true,length_policy=confidence,confidence_threshold=0.2"
PYTHONPATH=/tmp/wt-sure/src speculum bench $QWEN --dataset /tmp/mt86-97.jsonl,/tmp/mbpp1-6.jsonl --limit 12 \
  --out $OUT/i18/qwen-bf16-ouro-sure-tuning-p34 \
  --methods "autoregressive,autoregressive#2,ouroboros,$OURO,chain_stop_below=0.8#sure,auto"
# the calibration's top bin split in three, tried and reverted: the same prompts without (A) and with (B) it, B from a
# worktree with benchmarks/results/issue18-p34-calibration-top-bins.patch applied
git worktree add /tmp/wt-bins 276ead0 && git -C /tmp/wt-bins apply "$PWD/benchmarks/results/issue18-p34-calibration-top-bins.patch"
speculum bench $QWEN --dataset /tmp/mt86-97.jsonl,/tmp/mbpp1-6.jsonl --limit 12 --out $OUT/i18/qwen-bf16-bins-A-p34 \
  --methods "autoregressive,ouroboros,auto"
PYTHONPATH=/tmp/wt-bins/src speculum bench $QWEN --dataset /tmp/mt86-97.jsonl,/tmp/mbpp1-6.jsonl --limit 12 \
  --out $OUT/i18/qwen-bf16-bins-B-p34 --methods "autoregressive,ouroboros,auto"

# issue #18, thirty-fifth pass (AMD EPYC, avx512_bf16, bfloat16; prompt files as in the thirty-fourth pass)
# the chain's stop rules, acceptance-only, over the plain outputs the thirty-fourth pass recorded (costs as its runs measured)
python benchmarks/chain_stop_study.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --records $OUT/i18/qwen-bf16-chain-tuning-p34 $OUT/i18/qwen-bf16-chat-tuning-p34 --draft-seconds 0.060 --plain-seconds 0.130 \
  --out benchmarks/results/issue18-chain-stop-study-p35.md
# the draft-model gate forced on (an experimental option, from a worktree with the patch applied)
git worktree add /tmp/wt-keep 3686a49 && git -C /tmp/wt-keep apply "$PWD/benchmarks/results/issue18-p35-keep-draft-model.patch"
PYTHONPATH=/tmp/wt-keep/src speculum bench $QWEN --dataset /tmp/mt86-97.jsonl,/tmp/mbpp1-6.jsonl --limit 12 \
  --out $OUT/i18/qwen-bf16-keep-tuning-p35 --methods "autoregressive,autoregressive#2,ouroboros,auto,auto:keep_draft_model=true#keep"
# a request's first probe (tried and reverted; the patch holds its tests)
git worktree add /tmp/wt-probe 3686a49 && git -C /tmp/wt-probe apply "$PWD/benchmarks/results/issue18-p35-request-probe.patch"
PYTHONPATH=/tmp/wt-probe/src speculum bench $QWEN --dataset /tmp/mt86-97.jsonl,/tmp/mbpp1-6.jsonl --limit 12 \
  --out $OUT/i18/qwen-bf16-request-probe-tuning-p35 --methods "autoregressive,autoregressive#2,ouroboros,auto"
# auto's parts against Ouroboros' chain setting
speculum bench $QWEN --dataset /tmp/mt86-97.jsonl --limit 12 --out $OUT/i18/qwen-bf16-auto-parts-writing-p35 \
  --methods "autoregressive,ouroboros,auto,auto:drafters=ouroboros#ouro-only,auto:drafters=ouroboros,draft_depth=4,draft_confidence=0.2,chain_stop=true#ouro-only-ouro-chain"
speculum bench $QWEN --dataset /tmp/mt86-97.jsonl,/tmp/mbpp1-6.jsonl --limit 12 --out $OUT/i18/qwen-bf16-auto-ouro-chain-p35 \
  --methods "autoregressive,ouroboros,auto,auto:draft_depth=4,draft_confidence=0.2,chain_stop=true#ouro-chain"
# MT-bench's STEM and humanities questions (141-160: essay answers), written as the other prompt files
python - <<'PY'
import json
from speculum.bench.datasets import load_dataset
with open("/tmp/mt141-160.jsonl", "w") as f:
    for p in load_dataset("mt_bench")[60:80]:
        f.write(json.dumps({"question_id": p.question_id, "turns": [p.text]}) + "\n")
PY
speculum bench $QWEN --dataset /tmp/mt141-160.jsonl --limit 20 --out $OUT/i18/qwen-bf16-prose-p35 \
  --methods "autoregressive,ouroboros,auto,auto:draft_depth=4,draft_confidence=0.2,chain_stop=true#ouro-chain"

# issue #18, thirty-sixth pass (AMD EPYC, avx512_bf16, bfloat16): the writing comparison repeated on MT-bench 86-100
python - <<'PY'
import json
from speculum.bench.datasets import load_dataset
with open("/tmp/mt86-100.jsonl", "w") as f:
    for p in load_dataset("mt_bench")[5:20]:
        f.write(json.dumps({"question_id": p.question_id, "turns": [p.text]}) + "\n")
PY
for run in A B; do
  speculum bench $QWEN --dataset /tmp/mt86-100.jsonl --limit 15 --out $OUT/i18/qwen-bf16-writing-ab-$run-p36 \
    --methods "autoregressive,ouroboros,auto,auto:draft_depth=4,draft_confidence=0.2,chain_stop=true#auto-ouro-chain"
done
speculum bench $QWEN --dataset /tmp/mbpp1-6.jsonl,/tmp/mt101-112.jsonl,/tmp/wmt21-32.jsonl --limit 12 \
  --out $OUT/i18/qwen-bf16-chain-other-p36 \
  --methods "autoregressive,auto,auto:draft_depth=4,draft_confidence=0.2,chain_stop=true#auto-ouro-chain"
speculum bench $QWEN --dataset /tmp/mt86-100.jsonl --limit 15 --out $OUT/i18/qwen-bf16-writing-backoff-p36 \
  --methods "autoregressive,ouroboros,auto,auto:max_backoff=8#backoff8"

#!/usr/bin/env bash
# Megatron-LM launch snippet for a DeepSeek-V3 model built by dsv3_plugin (tested with megatron-core 0.16.1).
#
# One-time setup inside a Megatron-LM checkout (core_v0.16.1):
#   patch -p1 < /path/to/dsv3-plugin/patches/pretrain_gpt.diff
#   export PYTHONPATH=/path/to/dsv3-plugin:$PYTHONPATH
#
# The model shape comes from ds.json's "dsv3" block; the shape flags below are what Megatron-LM itself needs
# (argument validation, FLOP counts) and must agree with it (a mismatch is an error naming the flag).
# Parallelism, precision, data and optimizer flags are Megatron-LM's own, unchanged.
set -euo pipefail
DS_JSON=${DS_JSON:-ds.json}           # e.g. {"dsv3": {"preset": "v3-671b", "mtp": {"depth": 1}}}
NPROC=${NPROC:-8}

torchrun --nproc-per-node "$NPROC" pretrain_gpt.py \
    --dsv3-config "$DS_JSON" \
    --spec dsv3_plugin.megatron layer_spec \
    --transformer-impl transformer_engine \
    --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 \
    --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 \
    --qk-pos-emb-head-dim 64 --v-head-dim 128 --normalization RMSNorm --swiglu \
    --untie-embeddings-and-output-weights --disable-bias-linear --position-embedding-type none \
    --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --mtp-num-layers 1 \
    --seq-length 4096 --max-position-embeddings 163840 \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 16 --expert-model-parallel-size 64 \
    --micro-batch-size 1 --global-batch-size 15360 --bf16 \
    --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 129280 \
    --train-iters 100 --log-interval 1

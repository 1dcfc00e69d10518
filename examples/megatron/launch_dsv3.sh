#!/usr/bin/env bash
# DeepSeek-V3 (671B) pretraining with Megatron's own pretrain() loop and the dsv3_plugin model: the layout of the
# paper (§3.2, §4.2) on 2048 GPUs (256 nodes x 8). Run it on every node (NODE_RANK=0..255).
#
#   megatron-core >= 0.19:  pip install megatron-core==0.19.2 (the wheel ships megatron.training); nothing to patch.
#   megatron-core 0.16:     in a Megatron-LM core_v0.16.x checkout, `patch -p1 < patches/pretrain_gpt.diff` and put
#                           pretrain_gpt.py (with its path) in place of `-m dsv3_plugin.megatron.pretrain_gpt` below.
#
# The model comes from DS_JSON's "dsv3" block; the model flags below are Megatron's own and must agree with it
# (a contradiction is an error naming the flag and the dsv3 key; flags left out are filled from the block).
# Layout: PP16 with uneven first/last stages (3 + 14 x 4 + 2 = 61 layers; the MTP layer and the output head sit
# on the last stage), EP64 (256 experts, 4 per rank), TP1, data parallel 2048/16 = 128 with ZeRO-1 (Megatron's
# distributed optimizer shards optimizer state only). FP8: Transformer Engine's blockwise recipe (1x128 activation
# tiles, 128x128 weight blocks, E4M3), run by TE in the layers it builds (MLA projections) and by the plugin's FP8
# kernels in the DeepSeekMoE experts (docs/megatron.md, "FP8 with Megatron").
set -euo pipefail
NNODES=${NNODES:-256}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
DS_JSON=${DS_JSON:-ds_v3.json}      # {"dsv3": {"preset": "v3-671b", "parallel": {"schedule": "1f1b"}}}
CKPT=${CKPT:-checkpoints/dsv3}

MODEL=(
    --dsv3-config "$DS_JSON" --spec dsv3_plugin.megatron layer_spec --transformer-impl transformer_engine
    --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
    --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
    --v-head-dim 128 --qk-layernorm --rope-type yarn --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
    --rotary-base 10000 --max-position-embeddings 163840 --position-embedding-type none
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.006
    --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048
    --moe-layer-freq "([0]*3+[1]*58)" --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-num-groups 8 --moe-router-group-topk 4
    --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-router-dtype fp32 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3
)
PARALLEL=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 16
    --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2
    --expert-model-parallel-size 64 --expert-tensor-parallel-size 1 --use-distributed-optimizer
)
PRECISION=(--bf16 --fp8-format e4m3 --fp8-recipe blockwise)
TRAINING=(
    --seq-length 4096 --micro-batch-size 1 --global-batch-size 15360 --train-iters 500000
    --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
)
DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size 129280)   # or --data-path ... with your tokenizer
LOGGING=(--log-interval 1 --eval-interval 1000 --eval-iters 10 --save "$CKPT" --save-interval 1000 --load "$CKPT")

exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m dsv3_plugin.megatron.pretrain_gpt \
    "${MODEL[@]}" "${PARALLEL[@]}" "${PRECISION[@]}" "${TRAINING[@]}" "${DATA[@]}" "${LOGGING[@]}"

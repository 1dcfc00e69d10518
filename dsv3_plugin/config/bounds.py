"""Bounds of the `"dsv3"` block's sizes and times: far above DeepSeek-V3's value (in brackets) and every published
model's, low enough that a typo is refused before anything allocates or loops."""

__all__ = [
    "MAX_TIMEOUT_S",
    "MAX_VOCAB",
    "MAX_WIDTH",
    "MAX_FFN",
    "MAX_HEAD_DIM",
    "MAX_HEADS",
    "MAX_LAYERS",
    "MAX_POSITIONS",
    "MAX_EXPERTS",
    "MAX_SHARED",
    "MAX_PIPELINE",
    "MAX_MTP_DEPTH",
    "MAX_TOKENS",
]

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a timeout beyond a week is a typo (and 1e300 s overflows timedelta)

# Bounds of the sizes that allocate (issue 27: a typo must not ask for petabytes, or loop building 10^30 layers,
# before the memory estimate runs). Each is far above DeepSeek-V3's value (in brackets) and every published model's,
# and low enough that a loop over a count (layers, experts, ranks) ends quickly and the memory estimate, which then
# refuses what cannot fit, names the key.
MAX_VOCAB = 2**24  # [129280] 130x V3's; torch.multinomial (sampling, synthetic data) draws from at most 2^24 ids
MAX_WIDTH = 2**16  # [7168] hidden / LoRA ranks: one [width, width] matrix holds at most 2^32 elements
MAX_FFN = 2**18  # [18432 dense, 2048 per expert] FFN widths: 14x V3's dense FFN
MAX_HEAD_DIM = 2**12  # [128 / 64] per-head dims: 32x V3's; fused attention kernels stop at 256
MAX_HEADS = 1024  # [128]
MAX_LAYERS = 1024  # [61] 8x the deepest published LLMs (~126 layers); each layer is a module built one by one
MAX_POSITIONS = 2**24  # [163840] positions enter RoPE as FP32, exact only up to 2^24
MAX_EXPERTS = 2**14  # [256] routed experts (and EP ranks, groups, top-k, which are at most that many)
MAX_SHARED = 64  # [1] shared experts, one MLP of n_shared x intermediate_size
# [16] pipeline ranks: 2x the deepest published pipeline (64, Megatron-LM's 1T-parameter run); a step's schedule
# (>= 2 pp micro-batches on pp ranks: O(pp^2) ops, built in O(pp^3)) takes ~2 s to build at 128 and ~20 s at 256
MAX_PIPELINE = 128
MAX_MTP_DEPTH = 16  # [1] each depth is one more full MoE layer and one more loss
MAX_TOKENS = 1e18  # [14.8e12] tokens seen are counted in int64 (9.2e18)

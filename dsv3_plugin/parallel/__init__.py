"""Parallelism over torch.distributed (gloo on CPU, NCCL on GPU, same code): process start-up and groups
(`distributed`, `groups`), expert parallelism with node-limited, deduplicated all-to-all dispatch (`dispatch`,
`expert_parallel`; report §3.2.2) and pipeline parallelism (`pipeline/`: DualPipe, DualPipeV, 1F1B, ZB1P;
report §3.2.1)."""

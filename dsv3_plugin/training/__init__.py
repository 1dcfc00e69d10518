"""What a training run adds around the model: the transforms that set how it computes (`transforms`: FP8 →
recompute → EP → W-split), rank-local models (`rank_local`: meta → only what a rank of a PP x EP job
owns), recompute (`recompute`), EMA of the weights (`ema`), synthetic data (`data`),
routing telemetry and its plot (`telemetry`, `routing_plot`), the memory plan (`memory_plan`) and run
directories with their lock (`run_dir`), config identity (`run_record`), complete checkpoints and resume rules
(`checkpoint_tags`) and metrics file (`metrics_file`)."""

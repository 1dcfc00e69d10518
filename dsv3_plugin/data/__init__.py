"""What a run trains on. `synthetic`: the seeded Markov chain `dsv3 train` uses today (batches a pure function of
(seed, step, micro-batch, rank), so a checkpoint's data position is its step index)."""

from dsv3_plugin.data.batch import IGNORE_INDEX, Batch, document_ids
from dsv3_plugin.data.synthetic import MarkovData, batch_seed

__all__ = ["Batch", "IGNORE_INDEX", "document_ids", "MarkovData", "batch_seed"]

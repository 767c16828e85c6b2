"""Partitioning of the lifecycle (see the README's "Partitions" section for why).

* Data stages are **daily**: a day's newly landed documents are ingested, distilled and judged once.
* Packaging and training are **unpartitioned**: each materialization is a snapshot of all filtered data so far,
  trained into a new checkpoint with its own id.
* Evaluation and serving are partitioned by **checkpoint** (dynamic partitions): every checkpoint, whether
  trained here or copied into the checkpoint store by hand, is evaluated exactly once and can be served.
* Base models' evaluation is partitioned by **base model** (dynamic partitions ``base_models``).
"""


import dagster as dg

from nexa_dagster.core.common.config import load_pipeline_config

daily_partitions = dg.DailyPartitionsDefinition(
    start_date=str(load_pipeline_config()["partitions_start_date"]), end_offset=1
)
checkpoint_partitions = dg.DynamicPartitionsDefinition(name="checkpoints")
# one per pretrained base model (data/base_models/<id>), added by base_model: base_model_eval's partitions
base_model_partitions = dg.DynamicPartitionsDefinition(name="base_models")


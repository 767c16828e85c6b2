"""Partitioning of the lifecycle (docs/architecture.md, "Partitions", says why).

* Data stages are **daily**: a day's newly landed documents are ingested, distilled and judged once.
* Packaging and training are **unpartitioned**: each materialization is a snapshot of all filtered data so far,
  trained into a new checkpoint with its own id.
* Evaluation and serving are partitioned by **checkpoint** (dynamic partitions): every checkpoint, whether
  trained here or copied into the checkpoint store by hand, is evaluated exactly once and can be served.
* Base models' evaluation is partitioned by **base model** (dynamic partitions ``base_models``).
"""

import dagster as dg

from nexa_dagster import settings

# the first day is NEXA_PARTITIONS_START (default 2026-11-01): partitions exist when this module is imported, before
# any configuration file is read
daily_partitions = dg.DailyPartitionsDefinition(start_date=settings.PARTITIONS_START.get(), end_offset=1)
checkpoint_partitions = dg.DynamicPartitionsDefinition(name="checkpoints")
# one per pretrained base model (data/base_models/<id>), added by base_model: base_model_eval's partitions
base_model_partitions = dg.DynamicPartitionsDefinition(name="base_models")

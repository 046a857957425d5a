"""thdpack inside the trainers people already use: packing, context parallelism and the exact
global loss for transformers' ``Trainer`` and TRL's ``SFTTrainer``.

- :mod:`thdpack.integrations.transformers`: ``ThdpackTrainer`` (a ``transformers.Trainer``) and the
  mixin both trainers share (needs ``thdpack[trl]`` or ``thdpack[hf]``).
- :mod:`thdpack.integrations.packing_arguments`: ``PackingArguments``, the trainers' thdpack settings
  (generated from ``PlanConfig`` and ``PackedDatasetConfig``; imports neither transformers nor TRL).
- :mod:`thdpack.integrations.trl`: ``SFTTrainer``, TRL's trainer with thdpack's packing and CP in
  place of TRL's (needs ``thdpack[trl]``).
- :mod:`thdpack.integrations.trainer_data`: Hugging Face samples (``input_ids``, unshifted ``labels``)
  as thdpack samples, the trainers' ``PackedDataset`` of them, and the data loader that serves each
  rank its CP shard of every step.
- :mod:`thdpack.integrations.parallel`: the dp x cp ``CpTopology``, from accelerate's ``ParallelismConfig``
  or thdpack's ``cp_size``; :mod:`thdpack.integrations.stream_state`: the pack stream's state in
  a Trainer checkpoint.

``transformers`` and ``trl`` import transformers (and TRL) when they load, so this package imports none of them.
"""

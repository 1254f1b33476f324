"""The learner (issue D): DeepSpeed ZeRO-3 on token-level masks; publishes through ``WeightSink``."""

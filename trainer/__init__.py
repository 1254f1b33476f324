"""The learner (issue D): DeepSpeed ZeRO-3 on token-level masks.

It publishes weights through a ``WeightSink`` protocol and never imports the engine.
"""

"""The DeepSeek-V4.1 family (``model_type: deepseek_v41``, text-only ``deepseek_v41_text``),
built on V4's pieces: config (config.py), reference model (model.py: block.py, attention.py,
layers.py, engram.py, dspark.py for the DSpark stages), KV-cache layout (kv_cache.py), its
compiled pieces (fast/, compiled.py) and the family record the registry hands the engine
(family.py).

Nothing is imported here: the registry loads family.py on first lookup of the model_type.
"""

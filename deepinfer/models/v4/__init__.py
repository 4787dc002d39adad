"""The DeepSeek-V4 family (``model_type: deepseek_v4``): config (config.py), reference model
(model.py: block.py, attention.py, compressor.py, dspark.py for the DSpark stages), KV-cache
layout (kv_cache.py) and the family record the registry hands the engine (family.py). Its
compiled pieces are in fast/ (factories: compiled.py); the decode executor and the machinery
both families share are in models/fast/ (models/compiled.py).

Nothing is imported here: the registry loads family.py on first lookup of the model_type.
"""

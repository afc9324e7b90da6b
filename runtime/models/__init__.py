"""The model: the LLaMA-style decoder as an ordered list of layers (`llama`), Megatron-style
tensor parallelism within a stage (`tensor_parallel`), and Hugging Face weights read into
a worker's layers (`hf_weights`).

Imports `planaria.runtime.config`, `planaria.kernels` and `planaria.templates`; never
the engine, the layer state or the worker. Writing a model out as a Hugging Face
checkpoint reads a save, which is the layer state's (`planaria.runtime.state.hf_export`).
"""

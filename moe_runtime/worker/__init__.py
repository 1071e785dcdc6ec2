"""The worker side: one rank's model, KV cache, sampler and copy of the sequences it serves.

Never imports the engine; everything it learns of requests arrives through step_input.
"""

"""The CPU inference engine: continuous batching over any Hugging Face causal LM, served with vLLM's protocol.

``sampling`` (pure tensor functions), ``kv_cache`` (the batch's KV layout), ``scheduler`` (the
engine thread), ``protocol`` and ``app`` (HTTP), ``serve`` (the command).
"""

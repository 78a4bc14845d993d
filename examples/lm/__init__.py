"""A small causal language model with Tensor Memory, and how to decode with it.

``model.py`` -- :class:`TinyLM`: byte-level decoder blocks (causal attention with
a KV cache, optionally a sliding window; an MLP; a gated Tensor Memory in
``causal`` mode whose :class:`tmcore.layer.StreamState` is part of the cache).
``generate.py`` -- prefill a prompt, then decode token by token
(``python -m examples.lm.generate``). The decoded logits equal the
teacher-forced ones (tests/examples/test_lm_generation.py).
``baselines.py``, ``compare.py``, ``data.py`` -- the LM comparison
(``python -m examples.lm compare``, then ``render``): full, sliding-window,
Transformer-XL and linear attention against Tensor Memory at equal depth and width.
"""

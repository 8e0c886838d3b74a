"""Serving (text §2.2.6): requests scheduled over a KV memory, one concept a module, read in this order.

* :mod:`~kvlab.serve.config`: the engine's settings (:class:`EngineConfig`) and its time (:class:`CostModel`);
* :mod:`~kvlab.serve.job`: a request inside the engine, and where each fact of its sequence lives;
* :mod:`~kvlab.serve.memory`: the memory the scheduler asks (one protocol), paged and contiguous;
* :mod:`~kvlab.serve.events`: what the engine reports (admitted, preempted, swapped in, finished, reclaimed);
* :mod:`~kvlab.serve.metrics`: what each step and request measured;
* :mod:`~kvlab.serve.engine`: the scheduler, :class:`Engine` (continuous batching, tenants, preemption).

Then the model whose K/V the cache holds: :mod:`~kvlab.serve.model` (a Llama decoder writing into the pool),
:mod:`~kvlab.serve.loader` (a real model from its GGUF file), :mod:`~kvlab.serve.tokenizer`,
:mod:`~kvlab.serve.sampling` (choosing each next token),
:mod:`~kvlab.serve.chat` (chatting with it while the cache works), :mod:`~kvlab.serve.probe` (what one layer's
attention receives), :mod:`~kvlab.serve.reuse` (what a prefix hit saves on it), and :mod:`~kvlab.serve.claims`
(§2.2.6's results measured against a baseline).
"""

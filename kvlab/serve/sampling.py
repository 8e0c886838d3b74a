"""Choosing the next token from a model's logits: greedy, or temperature and top-p (nucleus) sampling.

The engine (:class:`~kvlab.serve.config.EngineConfig`'s ``temperature``, ``top_p`` and ``seed``) and
:class:`~kvlab.serve.chat.ChatSession` both sample with :func:`sample`: one rule for both, checked in one place.
"""
from __future__ import annotations

from typing import Any

import torch

from kvlab.core.checks import check_real
from kvlab.core.errors import ConfigError


def check_temperature(t: Any, what: str = "temperature") -> float:
    """A finite number >= 0 (0: greedy), else :class:`ConfigError` naming it."""
    return check_real(t, what, lo=0, note=" (0: greedy)")


def check_top_p(p: Any, what: str = "top_p") -> float:
    """A number in (0, 1] (1: no nucleus cut), else :class:`ConfigError` naming it."""
    return check_real(p, what, lo=0, hi=1, lo_open=True)


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> list[int]:
    """One token id per row of ``logits`` ``[batch, vocab]``.

    ``temperature`` 0 is greedy (the argmax). Otherwise the distribution is ``softmax(logits / temperature)``
    cut to its *nucleus*, the smallest set of most likely tokens whose probability reaches ``top_p``, and a token
    is drawn from it with ``generator`` (a CPU ``torch.Generator``; seeded, the draws repeat; None: torch's
    global one). Sampling runs on the CPU in fp32, so a seed gives the same tokens on every device."""
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or not logits.is_floating_point():
        raise ConfigError(f"logits must be a floating tensor [batch, vocab], got "
                          f"{logits.shape if isinstance(logits, torch.Tensor) else logits!r}")
    temperature, top_p = check_temperature(temperature), check_top_p(top_p)
    if generator is not None and not (isinstance(generator, torch.Generator) and generator.device.type == "cpu"):
        raise ConfigError(f"generator must be None or a CPU torch.Generator, got {generator!r}")
    if not logits.shape[0]:
        return []
    logits = logits.detach().float().cpu()
    top = logits.max(-1).values
    if torch.isnan(logits).any() or not torch.isfinite(top).all():
        raise ConfigError("logits hold NaN, or a row without any finite value: there is nothing to sample from")
    if temperature == 0:
        return [int(t) for t in logits.argmax(-1).tolist()]
    probs = ((logits - top[:, None]) / temperature).exp()  # softmax without its sum: multinomial normalises
    probs /= probs.sum(-1, keepdim=True)
    if top_p < 1:
        p, order = probs.sort(-1, descending=True)
        above = p.cumsum(-1) - p  # probability of the tokens ranked above each one
        p[above >= top_p] = 0.0   # the top token always stays (above = 0 < top_p)
        probs = torch.zeros_like(probs).scatter_(-1, order, p)
    return [int(t) for t in torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()]

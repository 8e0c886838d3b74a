"""Text in, token ids out (and back), for a real model: the byte-level BPE and the chat template its file holds.

A GGUF file carries its tokenizer as data: the vocabulary, the merge rules, which tokens are control tokens
(``<|im_start|>``, ``<|im_end|>``...) and a Jinja chat template that turns a list of messages into the prompt
text the model was trained on. :class:`ChatTokenizer` hands the BPE to the ``tokenizers`` library (Hugging
Face's Rust implementation, not a hand-written one) and renders the template in Jinja's sandbox (a template is
code from a file: the sandbox lets it format text and nothing else).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlab.core.checks import is_int
from kvlab.core.errors import ConfigError, ModelFileError

#: How a GGUF's ``tokenizer.ggml.pre`` splits text before BPE. ``smollm``: every digit is its own piece, then the
#: GPT-2 split (as llama.cpp's ``src/llama-vocab.cpp`` splits for ``LLAMA_VOCAB_PRE_TYPE_SMOLLM``); the GPT-2
#: ones: the GPT-2 split alone.
PRE_TOKENIZERS = ("smollm", "gpt-2", "gpt2", "default")
CONTROL = 3  # llama.cpp's token type of a control token (USER_DEFINED is 4: also matched whole)


class ChatTokenizer:
    """Byte-level BPE over ``tokens`` (id = position) and ``merges`` (``"a b"`` pairs, most frequent first),
    splitting text as ``pre`` says (:data:`PRE_TOKENIZERS`); tokens of type 3 or 4 in ``token_types`` are
    matched whole and never split. ``chat_template`` is the model's Jinja template; ``eos_id`` ends a turn."""

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str], pre: str,
                 chat_template: str | None, bos_id: int | None, eos_id: int) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        if pre not in PRE_TOKENIZERS:
            raise ModelFileError(f"pre-tokenizer {pre!r} is not one kvlab runs (it runs {', '.join(PRE_TOKENIZERS)})")
        if len(token_types) != len(tokens) or not all(is_int(t) for t in token_types):
            raise ModelFileError(f"{len(tokens)} tokens but {len(token_types)} token types")
        for what, i in (("eos", eos_id), ("bos", bos_id)):
            if i is not None and not (is_int(i) and 0 <= i < len(tokens)):
                raise ModelFileError(f"the {what} token id {i!r} is not in 0..{len(tokens) - 1}")
        pairs: list[tuple[str, str]] = []
        for m in merges:
            a, sep, b = m.partition(" ") if isinstance(m, str) else ("", "", "")
            if not (a and sep and b) or " " in b:
                raise ModelFileError(f"merge rule {m!r} is not two tokens separated by a space")
            pairs.append((a, b))
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ModelFileError("the vocabulary holds a token twice")
        try:
            bpe = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        except Exception as e:  # tokenizers' own error: a merge naming a token not in the vocabulary
            raise ModelFileError(f"the BPE tables are inconsistent: {e}") from None
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        bpe.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if pre == "smollm" else byte_level)
        bpe.decoder = decoders.ByteLevel()
        self.special = [i for i, t in enumerate(token_types) if t in (CONTROL, 4)]
        bpe.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in self.special])
        self._bpe, self.tokens = bpe, list(tokens)
        self.chat_template, self.bos_id, self.eos_id = chat_template, bos_id, eos_id
        self._template: Any = None

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids (control tokens written in it, like ``<|im_end|>``, become their one id)."""
        if not isinstance(text, str):
            raise ConfigError(f"text to encode must be a str, got {text!r:.80}")
        return list(self._bpe.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of ``ids`` (control tokens left out unless ``skip_special=False``). A token that ends inside
        a UTF-8 character shows as U+FFFD until the rest of it arrives (decode the whole answer so far)."""
        if not isinstance(ids, (list, tuple, range)) or not all(is_int(i) and 0 <= i < len(self.tokens)
                                                                for i in ids):
            raise ConfigError(f"ids to decode must be a list of ids in 0..{len(self.tokens) - 1}, got {ids!r:.80}")
        return str(self._bpe.decode([int(i) for i in ids], skip_special_tokens=skip_special))

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat: ``messages`` (``{"role": ..., "content": ...}``, roles ``system``,
        ``user``, ``assistant``) through the model's template; with ``add_generation_prompt`` it ends where the
        assistant's answer begins."""
        if self.chat_template is None:
            raise ConfigError("this model's file holds no chat template: encode plain text instead")
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["role"], str)
                and isinstance(m["content"], str) for m in messages):
            raise ConfigError(f"messages must be a non-empty list of {{'role': str, 'content': str}}, "
                              f"got {messages!r:.120}")
        if self._template is None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders
            try:
                self._template = env.from_string(self.chat_template)
            except TemplateError as e:
                raise ModelFileError(f"the chat template does not parse: {e}") from None
        bos = None if self.bos_id is None else self.tokens[self.bos_id]
        try:
            return str(self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                             bos_token=bos, eos_token=self.tokens[self.eos_id]))
        except Exception as e:  # a sandbox violation or a template bug: the file's fault, not the caller's
            raise ModelFileError(f"the chat template failed: {type(e).__name__}: {e}") from None

    def chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a chat (:meth:`render`, then :meth:`encode`)."""
        return self.encode(self.render(messages, add_generation_prompt))

    def __repr__(self) -> str:
        return f"ChatTokenizer({len(self.tokens)} tokens, {len(self.special)} control, eos {self.eos_id})"

"""A transformers tokenizer from a local directory, with the interface the recipes use."""

from __future__ import annotations

__all__ = ["HFTokenizer", "UNKNOWN"]

UNKNOWN = "\ufffd"  # the text of an id the tokenizer cannot decode (the replacement character)


class HFTokenizer:
    """encode / decode / pad_id / eos_id / bos_id over `AutoTokenizer.from_pretrained(path)`.
    Nothing is downloaded: `path` must hold the tokenizer files."""

    def __init__(self, path: str):
        from pathlib import Path

        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise FileNotFoundError(f"tokenizer directory {path} does not exist")
        # without any of these, transformers' message blames missing sentencepiece/tiktoken
        files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not any((Path(path) / name).is_file() for name in files):
            raise FileNotFoundError(f"tokenizer directory {path} holds none of the tokenizer "
                                    f"files {', '.join(files)}")
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if self._tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} has no eos token")
        self.eos_id = self._tok.eos_token_id
        # the ids that end a response: the eos token and a generation config's eos list (an
        # instruct model's end-of-turn token is often only there)
        self.stop_tokens = tuple(sorted({self.eos_id, *_generation_eos_ids(Path(path))}))
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        self.bos_id = self._tok.bos_token_id
        # bos where the tokenizer itself adds one (Llama 3), not where it only names one
        # (GPT-2's bos = eos, a WordLevel tokenizer without a template)
        self.adds_bos = self.bos_id is not None and (
            self._tok("0", add_special_tokens=True).input_ids[:1] == [self.bos_id])
        # ids decode(skip_special_tokens) drops, read as UNKNOWN inside a response (decode): the
        # named special tokens and every added token marked special (Llama 3's header tokens)
        self._no_text = frozenset(self._tok.all_special_ids) | {
            i for i, t in self._tok.added_tokens_decoder.items() if t.special}
        if self.adds_bos and self.bos_id == self.pad_id:
            raise ValueError(f"the tokenizer in {path} adds bos id {self.bos_id}, which is also "
                             f"its pad id: a prompt's bos would be read as left padding")

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """The text's ids, after the tokenizer's bos where it adds one (and add_bos), unless
        the text begins with it (a chat prompt template that writes <|begin_of_text|>)."""
        ids = self._tok.encode(text, add_special_tokens=False)
        bos = add_bos and self.adds_bos and ids[:1] != [self.bos_id]
        return ([self.bos_id] if bos else []) + ids

    def decode(self, ids) -> str:
        """The text up to the first stop token, without the padding: the leading and trailing
        runs of pad_id (the rollout's rule, rollout.prompt_mask_of). The leading run goes first:
        the pad id is often a stop id (pad = eos when the tokenizer has no pad token; Qwen3's
        pad is in its eos list). Inside the text, an id without text of its own (a special
        token: bos, a pad, <|im_start|>; unk; one past the vocabulary) reads as UNKNOWN."""
        ids = [int(i) for i in ids]
        start = 0
        while start < len(ids) and ids[start] == self.pad_id:
            start += 1
        ids = ids[start:]
        ids = ids[:next((at for at, i in enumerate(ids) if i in self.stop_tokens), len(ids))]
        while ids and ids[-1] == self.pad_id:
            ids.pop()
        # an id the tokenizer has no text for (past its vocabulary in a padded LM head, its
        # unk, a special token) reads as UNKNOWN: decode drops it, which joined its neighbours
        # ("4", <bos>, "2" read as 42) and could score a wrong response as right
        text, run = [], []
        for i in ids:
            if not 0 <= i < len(self._tok) or i in self._no_text:  # (unk is a special id)
                text += [self._tok.decode(run, skip_special_tokens=True), UNKNOWN]
                run = []
            else:
                run.append(i)
        return "".join(text) + self._tok.decode(run, skip_special_tokens=True)


def _generation_eos_ids(path) -> list[int]:
    """generation_config.json's eos_token_id (one id or a list), if the directory has one."""
    if not (path / "generation_config.json").is_file():
        return []
    from transformers import GenerationConfig

    ids = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)

"""tokenizer.json and tokenizer_config.json from a GGUF file's `tokenizer.*` metadata, built
with the `tokenizers` library: byte-level BPE (llama.cpp's "gpt2" tokenizer model), split as
the file's pre-tokenizer name says, its control tokens special."""

from __future__ import annotations

from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from runtime.checkpoints.gguf_file import GGUFFile

# llama.cpp's token types (llama_token_type / gguf.TokenType)
CONTROL, USER_DEFINED = 3, 4

# llama.cpp's split expressions (llama-vocab.cpp), as the models' own tokenizer.json files
# write them.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    """Every digit alone, then GPT-2's split (SmolLM2's own tokenizer.json)."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _qwen2() -> pre_tokenizers.PreTokenizer:
    return _split(_QWEN2)


# tokenizer.ggml.pre -> how text is split before BPE; llama.cpp's names.
PRE_TOKENIZERS = {
    "default": _gpt2,
    "gpt2": _gpt2,
    "smollm": _smollm,
    "llama-bpe": lambda: _split(_LLAMA3),
    "llama3": lambda: _split(_LLAMA3),
    "smaug-bpe": lambda: _split(_LLAMA3),
    "qwen2": _qwen2,
    "deepseek-r1-qwen": _qwen2,
}
# Llama 3's tokenizer takes a split piece whole when it is in the vocabulary (llama.cpp:
# ignore_merges; Hugging Face: "ignore_merges": true).
_IGNORE_MERGES = {"llama-bpe", "llama3", "smaug-bpe"}


def check_tokenizer(file: GGUFFile) -> None:
    model = file.get("tokenizer.ggml.model", None)
    if model != "gpt2":
        raise ValueError(
            f"{file.path.name}: tokenizer model {model!r} is not supported; "
            "we read byte-level BPE ('gpt2') tokenizers"
        )
    pre = file.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{file.path.name}: pre-tokenizer {pre!r} is not supported; "
            f"we know {', '.join(sorted(PRE_TOKENIZERS))}"
        )


def build_tokenizer(file: GGUFFile) -> Tokenizer:
    tokens: list[str] = file.get("tokenizer.ggml.tokens")
    types: list[int] = file.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in file.get("tokenizer.ggml.merges", [])]
    pre = file.get("tokenizer.ggml.pre", "default")
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES)
    )
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    if PRE_TOKENIZERS[pre] is _qwen2:
        # Qwen's own tokenizer.json composes Unicode first, and transformers' Qwen2Tokenizer
        # (what AutoTokenizer makes of any qwen2/qwen3 folder) does it whatever the file says;
        # llama.cpp and transformers' GGUF tokenizer do not: they differ on decomposed text
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, types, strict=True))
    # whole wherever they appear, with the ids they have (tokenizers reuses a vocabulary id)
    tokenizer.add_special_tokens([_added(t, special=True) for t, kind in typed if kind == CONTROL])
    tokenizer.add_tokens([_added(t, special=False) for t, kind in typed if kind == USER_DEFINED])
    tokenizer.post_processor = _post_processor(file, tokens)
    return tokenizer


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)


def _post_processor(file: GGUFFile, tokens: list[str]) -> processors.PostProcessor | None:
    """BOS and/or EOS around every encoded text, where the file asks for them."""
    ends = [
        (role, file.get(f"tokenizer.ggml.{role}_token_id", None))
        for role in ("bos", "eos")
        if file.get(f"tokenizer.ggml.add_{role}_token", False)
    ]
    ends = [(role, i) for role, i in ends if i is not None]
    if not ends:
        return None
    bos = [tokens[i] for role, i in ends if role == "bos"]
    eos = [tokens[i] for role, i in ends if role == "eos"]
    return processors.TemplateProcessing(
        single=" ".join([*bos, "$A", *eos]),
        pair=" ".join([*bos, "$A", *eos, *bos, "$B", *eos]),
        special_tokens=[(tokens[i], i) for _, i in ends],
    )


def tokenizer_config(file: GGUFFile) -> dict[str, Any]:
    tokens: list[str] = file.get("tokenizer.ggml.tokens")

    def token(role: str) -> str | None:
        index = file.get(f"tokenizer.ggml.{role}_token_id", None)
        return None if index is None else tokens[index]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(file.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(file.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": file.param("context_length"),
    }
    template = file.get("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config

"""Fill in the middle: a text completion's `suffix` (OpenAI's legacy field, which
Ollama and vLLM take too) becomes the model's own FIM prompt, made of the FIM
tokens its vocabulary holds; the model then writes what goes between `prompt`
and `suffix`, as code editors ask for when completing inside a file.

The families are told apart by their tokens, as llama.cpp does from a GGUF's
vocabulary. Each piece of text is tokenized on its own and the FIM tokens put
between as ids, so text that happens to spell a FIM token stays text. A model
whose vocabulary has none cannot do this: a non-empty `suffix` is then a 400,
never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierlm.serving.errors import APIError


@dataclass(frozen=True)
class FimFormat:
    prefix: int
    suffix: int
    middle: int
    bos: int | None  # put first when the tokenizer puts it first itself
    stops: tuple[int, ...]  # the tokens that end a middle, besides the end of the text


# (prefix, suffix, middle, tokens that end the middle); the first whose tokens
# the vocabulary holds wins. Codestral's [SUFFIX]/[PREFIX] are left out: Mistral's
# newer vocabularies hold them too, in models not trained for it, and its
# SentencePiece tokenizer would add a space before each piece.
_FAMILIES = (
    # Qwen2.5-Coder, Qwen3-Coder, CodeGemma
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
     ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|endoftext|>", "<|file_separator|>")),
    # StarCoder, StarCoder2, SantaCoder, Granite Code
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<fim_pad>", "<file_sep>", "<|endoftext|>")),
    # DeepSeek-Coder
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>", ()),
)


def find_format(tokenizer) -> FimFormat | None:
    """The FIM format of a tokenizer's vocabulary, or None if it has none."""
    vocab = tokenizer.get_vocab()
    for prefix, suffix, middle, stops in _FAMILIES:
        if prefix in vocab and suffix in vocab and middle in vocab:
            first = tokenizer.encode("a")
            bos = tokenizer.bos_token_id
            return FimFormat(
                prefix=vocab[prefix], suffix=vocab[suffix],
                middle=vocab[middle],
                bos=bos if bos is not None and first[:1] == [bos] else None,
                stops=tuple(vocab[s] for s in stops if s in vocab),
            )
    return None


def fim_tokens(fmt: FimFormat | None, tokenizer, prompt, suffix: str, model_name: str) -> list[int]:
    """The prompt ids of a completion of `prompt` (text) before `suffix`, or a 400
    when the model or the request cannot have one."""
    if fmt is None:
        raise APIError(400, f"'suffix': the model '{model_name}' has no fill-in-the-middle tokens in its "
                       "vocabulary, so it cannot complete between a prompt and a suffix",
                       "suffix", "unsupported")
    if not isinstance(prompt, str):
        raise APIError(400, "'suffix': fill-in-the-middle needs the prompt as text",
                       "prompt", "invalid_value")
    before = tokenizer.encode(prompt, add_special_tokens=False)
    after = tokenizer.encode(suffix, add_special_tokens=False)
    head = [] if fmt.bos is None else [fmt.bos]
    return [*head, fmt.prefix, *before, fmt.suffix, *after, fmt.middle]

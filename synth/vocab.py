"""A small byte-level BPE vocabulary that llama.cpp accepts as a ``gpt2`` tokenizer.

Layout of the token ids (the same for every vocabulary size, so tests can rely on it):

- ``0..255``: one token per byte value; id ``b`` is byte ``b``, spelled with GPT-2's
  byte-to-unicode mapping (``" "`` is ``"Ġ"``, ``"\\n"`` is ``"Ċ"``). Every byte string can be
  tokenized, so any text prompt works.
- ``256``: ``<|endoftext|>``, type CONTROL; it is both BOS and EOS.
- ``257..``: merged tokens, each made by one merge ``"a b"`` in ``tokenizer.ggml.merges``
  (token ``"ab"``). First those learned by plain BPE on a small built-in English corpus (about
  540), then, for bigger vocabularies, syllables and two-syllable pseudo-words (``"ka"``,
  ``"Ġka"``, ``"Ġkalo"``: about 8,300 more), so that every token spells text.
- Only past that (vocabularies over ~9,100) the rest are CONTROL tokens ``<|reserved_N|>``
  that text never tokenizes to.

llama.cpp needs at least one merge for a ``gpt2`` tokenizer (an empty array is not even written
by gguf-py), hence the minimum size of 258 tokens.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass

BYTE_TOKENS = 256
EOS_ID = 256  # also BOS
EOS_TEXT = "<|endoftext|>"
MIN_VOCAB = BYTE_TOKENS + 2  # bytes, <|endoftext|>, at least one merge

# gguf TokenType values (gguf.constants.TokenType); kept here so this module needs no gguf.
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3

# GPT-2's pre-tokenizer, restricted to ASCII (the corpus is ASCII, Python's `re` has no \p{L}).
# llama.cpp applies merges only inside these pieces, so training must split the same way.
_PRETOKENIZE = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")

_CORPUS = """\
The quick brown fox jumps over the lazy dog. Hello world! This is a small model made of random
weights, so what it says is noise, but the tokenizer is real: the text you give it is split into
bytes and merged into tokens the way a GPT-2 style tokenizer does it.
A mixture of experts model routes every token to a few experts out of many. The router picks the
top experts for each token, the experts compute their part, and the results are weighted and
summed. In a swarm, each worker holds some of the experts and answers when the backbone asks.
There was a time when the village by the river had only one bridge, and everyone who wanted to
cross it had to wait for the ferry in the winter when the water was high. The people of the
village built a second bridge, and then a third, and now they walk over the river whenever they
want to. The children play on the bank in the summer and the old men fish in the morning.
What is the weather like today? It is sunny and warm, with a light wind from the west. Tomorrow
it will rain in the afternoon, and the evening will be cold. Please take an umbrella with you.
def hello(name):
    return "Hello, " + name + "!"

for i in range(10):
    print(i, hello("world"))
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 24 32 64 100 128 256 512 1000 1024 2048 4096 2025.
The expert network is small, the message bus is fast, and the model answers the same way on one
machine as it does on many. Every selected expert is computed exactly once, by a node that owns
it, and the output must be equal to the output of the monolithic run.
She said that she would come back in the spring, when the trees are green again and the birds
have returned from the south. He did not believe her, but he waited anyway, and she came back.
They are going to the market on Saturday to buy bread, cheese, apples, and a bottle of milk.
I think therefore I am. To be or not to be, that is the question. All that glitters is not gold.
"""


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]  # id -> token text (byte-level unicode spelling)
    token_types: tuple[int, ...]  # id -> gguf TokenType
    merges: tuple[str, ...]  # "left right", in rank order
    eos_id: int = EOS_ID
    bos_id: int = EOS_ID


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character mapping."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def decode_token(text: str) -> bytes:
    """The bytes a (non-control) token stands for."""
    inverse = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(inverse[c] for c in text)


@functools.lru_cache(maxsize=16)
def build_vocab(size: int) -> Vocab:
    """A deterministic byte-level BPE vocabulary of exactly ``size`` tokens (``size >= 258``)."""
    if size < MIN_VOCAB:
        raise ValueError(f"vocabulary size {size} is too small: need at least {MIN_VOCAB} "
                         f"({BYTE_TOKENS} bytes, {EOS_TEXT}, one merge)")
    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(BYTE_TOKENS)] + [EOS_TEXT]
    types = [TOKEN_NORMAL] * BYTE_TOKENS + [TOKEN_CONTROL]
    merges = _train_merges(size - len(tokens))
    merges += _syllable_merges(size - len(tokens) - len(merges), {m.replace(" ", "") for m in merges})
    seen = set(tokens)
    for merge in merges:
        merged = merge.replace(" ", "")
        assert merged not in seen, merged  # _train_merges only returns merges making new tokens
        seen.add(merged)
        tokens.append(merged)
        types.append(TOKEN_NORMAL)
    for i in range(size - len(tokens)):
        tokens.append(f"<|reserved_{i}|>")
        types.append(TOKEN_CONTROL)
    return Vocab(tuple(tokens), tuple(types), tuple(merges))


@functools.lru_cache(maxsize=16)
def _train_merges(n_merges: int) -> tuple[str, ...]:
    """Plain BPE on the built-in corpus: up to ``n_merges`` merges, each making a new token.

    Ties between equally frequent pairs go to the smaller pair, so the result is deterministic.
    """
    byte_chars = bytes_to_unicode()
    words: Counter[tuple[str, ...]] = Counter(
        tuple(byte_chars[b] for b in piece.encode()) for piece in _PRETOKENIZE.findall(_CORPUS))
    merges: list[str] = []
    made: set[str] = set()
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += freq
        # a pair whose concatenation is already a token would add a merge but no token: skip it
        candidates = [(-n, pair) for pair, n in pairs.items() if pair[0] + pair[1] not in made]
        if not candidates:
            break
        _, (left, right) = min(candidates)
        merges.append(f"{left} {right}")
        made.add(left + right)
        words = Counter({_merge_word(w, left, right): f for w, f in words.items()})
    return tuple(merges)


_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def _syllable_merges(n_merges: int, made: set[str]) -> tuple[str, ...]:
    """Up to ``n_merges`` more merges, each making a new token, in a fixed order:
    syllables ``"k a"``, then ``"Ġ ka"``, then two-syllable words ``"Ġka lo"``.

    Each merge's parts are byte tokens or results of earlier merges (from the corpus or from
    an earlier step here), as llama.cpp's BPE needs.
    """
    space = bytes_to_unicode()[ord(" ")]
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    candidates = ([(c, v) for c in _CONSONANTS for v in _VOWELS]
                  + [(space, s) for s in syllables]
                  + [(space + s1, s2) for s1 in syllables for s2 in syllables])
    merges: list[str] = []
    made = set(made)
    for left, right in candidates:
        if len(merges) >= n_merges:
            break
        if left + right in made:
            continue
        merges.append(f"{left} {right}")
        made.add(left + right)
    return tuple(merges)


def _merge_word(word: tuple[str, ...], left: str, right: str) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
            out.append(left + right)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)

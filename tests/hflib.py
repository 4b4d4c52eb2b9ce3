"""Local Hugging Face assets for tests, built on the spot (no network): a BPE tokenizer trained with
`tokenizers` on a text the test writes, and the same documents as parquet, JSON Lines, Arrow
(`save_to_disk`) and a text folder, written with `datasets`."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

WORDS = ("the quick brown fox jumps over a lazy dog while the small cat sleeps near the warm fire and "
         "birds sing their songs in the tall green trees by the quiet river").split()


@dataclass
class HFAssets:
    root: Path
    tokenizer: Path  # folder (save_pretrained)
    big_tokenizer: Path  # a tokenizer with more tokens than small_model's vocabulary
    parquet: Path  # folder with train.parquet (columns: text, title, n)
    jsonl: Path  # folder with data.jsonl
    arrow: Path  # save_to_disk folder of a DatasetDict (train, test)
    with_empty_split: Path  # parquet folder: train.parquet and a 0-row validation.parquet
    text_folder: Path  # one .txt document per file
    small_model: Path  # an hf: model folder (config.json only) with a 320-token vocabulary
    docs: list[str]


def documents(n: int = 300, seed: int = 0) -> list[str]:
    """Sentences over a small vocabulary: a tiny model learns them within a few dozen steps."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 120))) + "." for _ in range(n)]


def offline_env(root: Path) -> dict[str, str]:
    """Environment for a node or a library call: Hub forbidden, caches under ``root``."""
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(root / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}


def _train_tokenizer(texts: list[str], vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(str(out))


def build_assets(root: Path) -> HFAssets:
    import datasets
    from transformers import LlamaConfig

    datasets.disable_progress_bars()
    root.mkdir(parents=True, exist_ok=True)
    docs = documents()
    corpus_file = root / "corpus.txt"
    corpus_file.write_text("\n".join(docs))
    _train_tokenizer([corpus_file.read_text()], 300, root / "tokenizer")
    _train_tokenizer([corpus_file.read_text() + "".join(chr(0x4E00 + i) for i in range(400))], 800,
                     root / "big-tokenizer")

    table = datasets.Dataset.from_dict({"text": docs, "title": [d[: len(d) // 2] for d in docs], "n": list(range(len(docs)))})
    (root / "parquet").mkdir()
    table.to_parquet(str(root / "parquet" / "train.parquet"))
    (root / "jsonl").mkdir()
    table.to_json(str(root / "jsonl" / "data.jsonl"))
    datasets.DatasetDict({"train": table, "test": table.select(range(10))}).save_to_disk(str(root / "arrow"))
    (root / "with-empty").mkdir()
    table.to_parquet(str(root / "with-empty" / "train.parquet"))
    table.select([]).to_parquet(str(root / "with-empty" / "validation.parquet"))
    (root / "text").mkdir()
    for i, d in enumerate(docs[:60]):
        (root / "text" / f"doc{i:03d}.txt").write_text(d)
    LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=128).save_pretrained(str(root / "small-model"))
    return HFAssets(root, root / "tokenizer", root / "big-tokenizer", root / "parquet", root / "jsonl", root / "arrow",
                    root / "with-empty", root / "text", root / "small-model", docs)

"""Real tokenizers, datasets and models (issue 11), in process: what a node builds from --tokenizer,
--dataset hf:... and --model, their identities in the run spec, their errors, and the export.

Everything is built locally (tests/hflib.py); the Hub is forbidden (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from hflib import build_assets, offline_env

from diloco_swarm.data import DatasetError
from diloco_swarm.spec import RunSpec, SpecMismatch


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in offline_env(root).items():
            mp.setenv(k, v)
        yield build_assets(root)


def spec(**changes) -> RunSpec:
    base = dict(run_id="hf", model="llama-tiny", dataset="(set from the data)", seq_len=32, inner_steps=10,
                inner_lr=1e-3, outer_lr=0.7, outer_momentum=0.9, seed=0)
    return RunSpec(**{**base, **changes})


def build(assets_, dataset, tokenizer=None, **changes):
    from diloco_swarm.node.assets import build_run_assets

    lines = []
    return build_run_assets(spec(**changes), dataset=dataset, tokenizer_arg=tokenizer or str(assets_.tokenizer),
                            max_bytes=None, log=lines.append)


# --- tokenizers -----------------------------------------------------------------------------


def test_tokenizer_identity_is_a_hash_of_its_files_and_survives_a_copy(assets, tmp_path):
    import shutil

    from diloco_swarm.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(assets.tokenizer))
    assert tok.identity.startswith("sha256:") and tok.vocab_size == 300
    assert tok.separator == [tok._hf.eos_token_id]
    shutil.copytree(assets.tokenizer, tmp_path / "copy")
    assert load_tokenizer(str(tmp_path / "copy")).identity == tok.identity
    assert load_tokenizer(str(assets.big_tokenizer)).identity != tok.identity
    # a bare tokenizer.json loads too (its identity covers that one file)
    single = load_tokenizer(str(assets.tokenizer / "tokenizer.json"))
    assert single.vocab_size == 300 and single.encode_batch(["the fox"])[0].tolist() == tok.encode_batch(["the fox"])[0].tolist()


# --- datasets --------------------------------------------------------------------------------


def test_parquet_jsonl_and_arrow_give_the_same_tokens_and_a_content_held_out_split(assets):
    from diloco_swarm.data.hf_corpus import is_held_out

    built = {name: build(assets, f"hf:{path}") for name, path in
             (("parquet", assets.parquet), ("jsonl", assets.jsonl), ("arrow", assets.arrow))}
    ref = built["parquet"].corpus
    for b in built.values():
        assert np.array_equal(b.corpus.train, ref.train) and np.array_equal(b.corpus.held_out, ref.held_out)
        assert b.corpus.train.dtype == np.uint16
    n_held = sum(is_held_out(d) for d in assets.docs)
    assert 0 < n_held < len(assets.docs) // 10
    # every token is one of the tokenizer's, documents are joined by its EOS
    assert int(ref.train.max()) < 300
    eos = built["parquet"].tokenizer.separator[0]
    assert int((ref.train == eos).sum()) == len(assets.docs) - n_held - 1
    # identity: files (relative paths, sizes), split and column; the same file alone is the same data
    assert ref.description.startswith("hf:local:1:") and ref.description.endswith("@train#text")
    assert build(assets, f"hf:{assets.parquet / 'train.parquet'}").description == ref.description
    assert built["jsonl"].description != ref.description
    other_column = build(assets, f"hf:{assets.parquet}#title")
    assert other_column.description.endswith("#title") and len(other_column.corpus.train) < len(ref.train)


def test_text_folder_reads_one_document_per_file(assets):
    b = build(assets, f"hf:{assets.text_folder}")
    eos = b.tokenizer.separator[0]
    assert int((b.corpus.train == eos).sum()) + int((b.corpus.held_out == eos).sum()) + 2 == 60


@pytest.mark.parametrize("suffix, expected", [
    ("#body", "has no column 'body' in split 'train' (columns: text, title, n)"),
    ("#n", "column 'n' holds int64 values, not text"),
    ("@validation", "has no split 'validation' (it has: train)"),
])
def test_bad_column_or_split_is_one_line(assets, suffix, expected):
    with pytest.raises(DatasetError) as info:
        build(assets, f"hf:{assets.parquet}{suffix}")
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_empty_split_is_refused(assets):
    with pytest.raises(DatasetError, match="split 'validation' is empty"):
        build(assets, f"hf:{assets.with_empty_split}@validation")
    with pytest.raises(DatasetError, match=r"has no split 'dev' \(it has: train, validation\)"):
        build(assets, f"hf:{assets.with_empty_split}@dev")
    assert len(build(assets, f"hf:{assets.arrow}@test").corpus.train) > 0


def test_batches_follow_seed_peer_and_outer_step(assets):
    b = build(assets, f"hf:{assets.parquet}")
    s = b.sampler(4, 32, seed=0, stream_id="peer-a")
    first = [x for x, _ in s.batches_for_outer_step(3, 2)]
    again = [x for x, _ in b.sampler(4, 32, seed=0, stream_id="peer-a").batches_for_outer_step(3, 2)]
    assert all(torch.equal(a, c) for a, c in zip(first, again))  # a restart at outer step 3 reads the same
    step0 = next(s.batches_for_outer_step(0, 1))[0]
    other_peer = next(b.sampler(4, 32, seed=0, stream_id="peer-b").batches_for_outer_step(3, 1))[0]
    assert not torch.equal(first[0], step0) and not torch.equal(first[0], other_peer)


def test_stream_sampler_is_deterministic_and_skips_held_out_documents(assets):
    """The streaming path (Hub datasets) on a local parquet stream: same contract as BatchSampler."""
    import datasets

    from diloco_swarm.data.hf_corpus import StreamSampler, is_held_out, stream_held_out
    from diloco_swarm.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(assets.tokenizer))

    def open_stream():
        return datasets.load_dataset("parquet", data_files=str(assets.parquet / "train.parquet"), split="train",
                                     streaming=True)

    def batches(peer, step, n=3):
        return [x for x, _ in StreamSampler(open_stream, "text", tok, 2, 32, 0, peer, buffer_size=64)
                .batches_for_outer_step(step, n)]

    a = batches("p", 5)
    assert all(torch.equal(x, y) for x, y in zip(a, batches("p", 5)))
    assert not torch.equal(a[0], batches("p", 6)[0]) and not torch.equal(a[0], batches("q", 5)[0])
    assert a[0].shape == (2, 32) and a[0].dtype == torch.int64
    held = stream_held_out(open_stream, "text", tok)
    expected = sum(len(tok.encode_batch([d])[0]) + 1 for d in assets.docs if is_held_out(d))
    assert len(held) == expected
    # no training window holds a held-out document's first 16 tokens
    probes = [tok.encode_batch([d])[0][:16].tolist() for d in assets.docs if is_held_out(d)]
    rows = [r.tolist() for x in batches("p", 7, n=20) for r in x]
    for probe in probes:
        assert not any(probe == r[i:i + 16] for r in rows for i in range(len(r) - 15))


# --- models and the run spec ------------------------------------------------------------------


def test_llama_presets_shapes_and_seeded_init():
    from diloco_swarm.models import hf
    from diloco_swarm.models.registry import build, resolve_model

    tiny = build(resolve_model("llama-tiny"), seed=7, vocab_size=320)
    again = build(resolve_model("llama-tiny"), seed=7, vocab_size=320)
    assert all(torch.equal(a, b) for a, b in zip(tiny.module.parameters(), again.module.parameters()))
    n = sum(p.numel() for p in tiny.module.parameters())
    print(f"llama-tiny (vocab 320): {n / 1e6:.2f}M parameters")
    assert 2e6 < n < 6e6 and tiny.module.config.block_size == 1024
    for name, (h, layers, heads, ffn) in {"llama-150m": (1024, 12, 16, 4096), "llama-1b": (2048, 22, 32, 5632)}.items():
        c = hf.llama_config(name, 32000)
        assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (h, layers, heads, ffn)
    assert hf.padded_vocab(300) == 320 and hf.padded_vocab(32000) == 32000


def test_model_tokenizer_and_data_identities_enter_the_run_spec(assets):
    b = build(assets, f"hf:{assets.parquet}")
    s = b.spec
    assert (s.model, s.vocab_size, s.tokenizer) == ("llama-tiny", 320, b.tokenizer.identity)
    dumped = s.model_dump()
    assert dumped["tokenizer"] == s.tokenizer and dumped["dataset"] == b.description
    # another tokenizer, another column, another model config: refused, naming the field
    other_tok = build(assets, f"hf:{assets.parquet}", tokenizer=str(assets.big_tokenizer)).spec
    other_col = build(assets, f"hf:{assets.parquet}#title").spec
    hf_model = build(assets, f"hf:{assets.parquet}", model=f"hf:{assets.small_model}").spec
    assert hf_model.model.startswith("hf:config=") and ",weights=" not in hf_model.model
    for other, fields in ((other_tok, {"tokenizer", "vocab_size"}), (other_col, {"dataset"}),
                          (hf_model, {"model"})):
        diffs = s.differences(other)
        assert set(diffs) == fields, diffs
        message = str(SpecMismatch("hf", diffs))
        assert all(f"{f}: ours=" in message for f in fields) and "\n" not in message


def test_byte_runs_keep_their_spec_hash():
    """tokenizer/vocab_size are left out at their byte defaults: runs and checkpoints from before agree."""
    s = spec(model="tiny", dataset="python-stdlib")
    assert "tokenizer" not in s.model_dump() and "vocab_size" not in s.model_dump()
    assert RunSpec.model_validate(s.model_dump()) == s
    # the spec of protocol 7 (issue 39's paused peers and ledger) without these fields; at their byte defaults they add nothing
    assert s.spec_hash() == "02819e1debc0f795"


def test_vocabulary_rules(assets):
    from diloco_swarm.models.registry import ModelError

    with pytest.raises(ModelError, match="the tokenizer has 800 tokens but the vocabulary of --model hf:.* holds 320"):
        build(assets, f"hf:{assets.parquet}", model=f"hf:{assets.small_model}", tokenizer=str(assets.big_tokenizer))
    with pytest.raises(ModelError, match="byte-level preset"):
        build(assets, f"hf:{assets.parquet}", model="tiny")
    from diloco_swarm.node.assets import AssetError, default_tokenizer

    with pytest.raises(AssetError, match="needs --tokenizer"):
        default_tokenizer("llama-150m", None, None)
    assert default_tokenizer("tiny", None, None) == "byte"


# --- command line: one line, exit 2 -------------------------------------------------------------


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The contract for bad input: exit 2, no traceback, exactly one line on stderr, `error: ...`."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def run_all(commands: dict[str, list[str]], env: dict[str, str] | None = None, timeout: float = 240):
    """Run the commands at once (their imports overlap) and return {name: CompletedProcess}."""
    procs = {name: subprocess.Popen([sys.executable, "-m", "diloco_swarm", *cmd], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)
             for name, cmd in commands.items()}
    done = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=timeout)
            done[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


BAD_INPUT = {
    "missing column": "has no column 'body'",
    "empty split": "split 'validation' is empty",
    "tokenizer too big": "the tokenizer has 800 tokens",
    "hub dataset offline": "offline",
    "hub model offline": "offline",
    "masked LM config": "is BertForMaskedLM, not a causal language model",
}


@pytest.fixture(scope="module")
def bad_input_runs(assets):
    from transformers import BertConfig

    tok = ["--tokenizer", str(assets.tokenizer)]
    bert = assets.root / "bert-config"  # an encoder: it would build, then train masked-token prediction
    BertConfig(vocab_size=1024, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
               architectures=["BertForMaskedLM"]).save_pretrained(bert)
    args = {
        "missing column": ["--model", "llama-tiny", *tok, "--dataset", f"hf:{assets.parquet}#body"],
        "empty split": ["--model", "llama-tiny", *tok, "--dataset", f"hf:{assets.with_empty_split}@validation"],
        "tokenizer too big": ["--model", f"hf:{assets.small_model}", "--tokenizer", str(assets.big_tokenizer),
                              "--dataset", f"hf:{assets.parquet}"],
        "hub dataset offline": ["--model", "llama-tiny", *tok, "--dataset", "hf:allenai/c4:en@train#text"],
        "hub model offline": ["--model", "hf:PrimeIntellect/llama-150m-fresh", *tok],
        "masked LM config": ["--model", f"hf:{bert}", *tok, "--dataset", f"hf:{assets.parquet}"],
    }
    common = ["join", "--host", "127.0.0.1", "--port", "0", "--threads", "1", "--compression", "fp32",
              "--seq-len", "32"]
    env = {**__import__("os").environ, **offline_env(assets.root)}
    return run_all({name: [*common, "--state-dir", str(assets.root / f"state-{i}"), *a]
                    for i, (name, a) in enumerate(args.items())}, env=env)


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(bad_input_runs, case):
    assert BAD_INPUT[case] in one_error_line(bad_input_runs[case])


# --- export ------------------------------------------------------------------------------------


def _fake_trained_state(state_dir, model_name, seed=3, extra=None, **spec_changes):
    """A checkpoint as a node writes it, with θ_global moved away from the initial weights (``extra``: more keys)."""
    from diloco_swarm.models.registry import build, resolve_model
    from diloco_swarm.node.checkpoint import save_checkpoint
    from diloco_swarm.node.outer import OuterOptimizer

    built = build(resolve_model(model_name), seed=seed, vocab_size=spec_changes.get("vocab_size", 256))
    with torch.no_grad():
        for p in built.module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    s = spec(model=model_name, seed=seed, **spec_changes)
    save_checkpoint(state_dir, {"spec": s.model_dump(), "outer": OuterOptimizer(built.module.parameters()).state_dict(),
                                "outer_step": 4, "tokens_total": 1000, **(extra or {})})
    return built.module


def test_byte_preset_exports_as_gpt2_with_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from diloco_swarm.node.export import export_model

    trained = _fake_trained_state(tmp_path / "state", "tiny").eval()
    info = export_model(tmp_path / "state", tmp_path / "out")
    assert info["architecture"] == "GPT2LMHeadModel" and "model.safetensors" in info["files"]
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    x = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, trained(x)[0], atol=1e-5)
    assert json.loads((tmp_path / "out" / "diloco-export.json").read_text())["outer_step"] == 4


def test_the_export_has_a_model_card_with_the_loss_curve_and_the_contributors(tmp_path):
    """README.md loads with huggingface_hub's ModelCard: the run spec in its YAML, the held-out loss by
    outer step from STATE_DIR/metrics.jsonl (this node's records only), and the contributors of the
    node's last leaderboard, first-hand rows apart from self-reported ones; a name cannot break the table."""
    from huggingface_hub import ModelCard

    from diloco_swarm.dht.ledger import leaderboard
    from diloco_swarm.node.export import export_model

    me, partner, boaster = "QmMe", "QmPartner", "QmBoaster"
    rec = lambda peer, name, tokens, rounds, with_: {  # noqa: E731
        "peer_id": peer, "name": name, "tokens_total": tokens, "verified_rounds": rounds, "uptime_s": 600.0,
        "rounds_with": [{"peer_id": p, "rounds": r, "tokens": t} for p, r, t in with_]}
    rows = leaderboard([rec(me, "alice", 1000, 4, [(partner, 4, 900)]), rec(partner, "bob", 900, 4, [(me, 4, 1000)]),
                        rec(boaster, "eve | <b>", 10**9, 40, [])], first_hand={me, partner})
    ledger = {"verified_rounds": 4, "rounds_with": [[partner, 4, 900]], "leaderboard": rows}
    _fake_trained_state(tmp_path / "state", "tiny", extra={"peer_id": me, "ledger": ledger})
    lines = [{"event": "eval", "peer_id": me, "outer_step": 0, "eval_loss": 5.5},
             {"event": "outer_step", "peer_id": me, "outer_step": 2, "eval_outer_step": 2, "eval_loss": 3.25},
             {"event": "outer_step", "peer_id": "QmOther", "outer_step": 3, "eval_outer_step": 3, "eval_loss": 0.1},
             {"event": "outer_step", "peer_id": me, "outer_step": 4, "eval_outer_step": 4, "eval_loss": 2.5}]
    (tmp_path / "state" / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\nnot json\n")
    info = export_model(tmp_path / "state", tmp_path / "out")
    assert "README.md" in info["files"]
    card = ModelCard.load(tmp_path / "out" / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["diloco_swarm"]["outer_steps"] == 4
    assert data["diloco_swarm"]["tokens_trained"] == 1000 and data["diloco_swarm"]["inner_steps"] == spec().inner_steps
    table = [line for line in card.text.splitlines() if line.startswith("| ")]
    assert [t for t in table if t.split("|")[1].strip() in ("0", "2", "3", "4")] == [
        "| 0 | 5.5000 |", "| 2 | 3.2500 |", "| 4 | 2.5000 |"]
    by_name = {t.split("|")[1].strip(): t for t in table}
    assert "this peer" in by_name["alice"] and "first-hand: 4 verified rounds with this peer" in by_name["bob"]
    boasts = [t for t in table if boaster in t]
    assert len(boasts) == 1 and "self-reported" in boasts[0] and "eve \\| &lt;b&gt;" in boasts[0]
    assert len(re.findall(r"(?<!\\)\|", boasts[0])) == 8  # the name's "|" is escaped: still 7 cells


def test_an_export_follows_the_umask(tmp_path):
    """An export is made to be shared: its folder and files take the user's umask (0755/0644 under 022;
    they were 0700/0600), as a folder the user made would; under 077 they stay the user's alone."""
    import stat

    from diloco_swarm.node.export import export_model

    _fake_trained_state(tmp_path / "state", "tiny")
    for umask, folder_mode, file_mode in ((0o022, 0o755, 0o644), (0o077, 0o700, 0o600)):
        before = os.umask(umask)
        try:
            out = tmp_path / f"out-{umask:03o}"
            export_model(tmp_path / "state", out)
        finally:
            os.umask(before)
        assert stat.S_IMODE(out.stat().st_mode) == folder_mode, oct(out.stat().st_mode)
        files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*")}
        assert "model.safetensors" in files and set(files.values()) == {file_mode}, {n: oct(m) for n, m in files.items()}


def test_export_errors_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated" * 10)
    _fake_trained_state(tmp_path / "ok", "tiny")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "afile").write_text("")  # an empty file is no folder to export into
    cases = {"missing": ("none", "o1", "does not exist"), "no checkpoint": ("empty", "o2", "holds no checkpoint"),
             "corrupt": ("bad", "o3", "corrupt or truncated"), "out not empty": ("ok", "full", "not empty"),
             "out a file": ("ok", "afile", "is an existing file"),
             # the kernel refuses new files in /proc even to root; the message names --out, not its temp folder
             "out not writable": ("ok", "/proc/nc-exp", "--out /proc/nc-exp cannot be written")}
    runs = run_all({name: ["export", "--state-dir", str(tmp_path / sd), "--out", str(tmp_path / out)]
                    for name, (sd, out, _) in cases.items()}, timeout=120)
    for name, (_, _, expected) in cases.items():
        assert expected in one_error_line(runs[name]), name
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


def test_hf_model_folder_with_weights_is_the_starting_point(assets, tmp_path):
    """hf:FOLDER with model.safetensors: θ starts from those weights (not the seed), and they enter the identity."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from diloco_swarm.models.registry import build, resolve_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)
        pretrained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(assets.small_model)))
    pretrained.save_pretrained(str(tmp_path / "weights"))
    a = build(resolve_model(f"hf:{tmp_path / 'weights'}"), seed=0, vocab_size=320)
    b = build(resolve_model(f"hf:{tmp_path / 'weights'}"), seed=5, vocab_size=320)
    assert ",weights=" in a.identity and a.identity == b.identity
    assert all(torch.equal(p, q) for p, q in zip(a.module.parameters(), pretrained.parameters()))
    config_only = build(resolve_model(f"hf:{assets.small_model}"), seed=0, vocab_size=320)
    assert config_only.identity == a.identity.split(",")[0]


def test_a_few_documents_with_a_large_last_one_hold_out_its_tail_not_all_of_it(assets, tmp_path):
    """Too few documents for the 1-in-50 rule: the last one is held out, unless it holds over a tenth
    of the tokens; then only its last 5% is (a newcomer's 4 documents held out 68% of the data)."""
    import datasets

    from diloco_swarm.data.hf_corpus import is_held_out

    docs = [d for d in assets.docs if not is_held_out(d)][:3]
    docs.append(" ".join(assets.docs))  # the last document: more text than all the others together
    datasets.Dataset.from_dict({"text": docs}).to_parquet(str(tmp_path / "few.parquet"))
    corpus = build(assets, f"hf:{tmp_path / 'few.parquet'}").corpus
    total = len(corpus.train) + len(corpus.held_out)
    assert 0 < len(corpus.held_out) <= 0.05 * total, (len(corpus.held_out), total)

"""Issue 11 end to end: 2 real `diloco-node join` processes train llama-tiny with a locally trained BPE
tokenizer on a local parquet dataset (`--dataset hf:<folder>`); a third peer reading another column is
refused; `diloco-node export` of the result loads with transformers; a restarted peer resumes its data
order. No network beyond 127.0.0.1 (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hflib import build_assets, offline_env
from swarmlib import Swarm, theta_by_step

pytestmark = [pytest.mark.swarm]


@pytest.mark.timeout(600)
def test_llama_tiny_on_parquet_two_peers_agree_export_and_resume(tmp_path, monkeypatch):
    for k, v in offline_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    assets = build_assets(tmp_path / "assets")
    dataset = f"hf:{assets.parquet}"
    extra = ["--model", "llama-tiny", "--tokenizer", str(assets.tokenizer), "--dataset", dataset,
             "--seq-len", "32", "--max-outer-steps", "3", "--wait-for-peers", "2"]
    with Swarm(tmp_path, "llama2", extra=extra) as swarm:
        a = swarm.start("a", timeout=180)
        b = swarm.start("b", initial=a, wait_start=False)
        # same run id, another text column: a different run spec, refused before training
        c = swarm.start("c", "--dataset", f"{dataset}#title", initial=a, wait_start=False)
        assert swarm.wait_exit(c, 240) == 2, c.output()[-3000:]
        errors = [line for line in c.output().splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "dataset: ours='hf:local:" in errors[0] and "#title" in errors[0], errors
        for node in (a, b):
            assert swarm.wait_exit(node, 420) == 0, node.output()[-3000:]

        for node in (a, b):
            start = node.events("start")[0]
            assert start["outer_step"] == 0
            rounds = node.outer_steps()
            assert len(rounds) == 3, rounds
            assert sum(r["round_ok"] for r in rounds) >= 2, rounds
            first_eval = node.events("eval")[0]["eval_loss"]
            assert rounds[-1]["eval_loss"] < first_eval - 0.3, (first_eval, rounds[-1]["eval_loss"])
        held = {n.name: theta_by_step(n) for n in (a, b)}
        ok_steps = [r["outer_step"] for r in a.outer_steps() if r["round_ok"]]
        common = [s for s in ok_steps if s in held["a"] and s in held["b"]]
        assert common and all(held["a"][s] == held["b"][s] for s in common), held

        # export the run and load it with transformers
        out = tmp_path / "export"
        proc = subprocess.run([sys.executable, "-m", "diloco_swarm", "export", "--state-dir", str(a.state_dir),
                               "--out", str(out)], capture_output=True, text=True, timeout=180, env=dict(os.environ))
        assert proc.returncode == 0, proc.stderr
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from diloco_swarm.node.export import node_model

        hf_model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(out))
        assert type(hf_model).__name__ == "LlamaForCausalLM" and len(tokenizer) == 300
        # generate() stops on the run's own <eos>, not on transformers' default id 2
        eos = tokenizer.convert_tokens_to_ids("<eos>")
        assert hf_model.config.eos_token_id == hf_model.generation_config.eos_token_id == eos
        assert hf_model.config.bos_token_id is None  # this tokenizer has none
        prompt = tokenizer("the quick brown fox", return_tensors="pt").input_ids
        generated = hf_model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        assert generated.shape[1] == prompt.shape[1] + 5
        ours, spec, _ = node_model(a.state_dir)
        x = torch.tensor(assets_tokens(tokenizer, assets.docs[:2], 48))
        with torch.no_grad():
            theirs_logits, (our_logits, _) = hf_model(input_ids=x).logits, ours(x)
        assert torch.allclose(theirs_logits, our_logits, atol=1e-4), (theirs_logits - our_logits).abs().max()
        assert spec.model == "llama-tiny" and spec.vocab_size == 320

        # a restarted peer resumes at its outer step, with its peer id: its data order goes on from there
        b2 = swarm.start("b", "--wait-for-peers", "0", timeout=180)
        assert swarm.wait_exit(b2, 120) == 0, b2.output()[-3000:]
        restart = b2.events("start")[-1]
        assert restart["outer_step"] == 3 and restart["peer_id"] == b.events("start")[0]["peer_id"]
        assert "resumed from" in b2.output()


def assets_tokens(tokenizer, docs: list[str], length: int) -> list[list[int]]:
    return [tokenizer(d).input_ids[:length] for d in docs]

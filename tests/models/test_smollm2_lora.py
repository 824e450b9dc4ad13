"""A real LoRA adapter on the real model (issue 44): SmolLM2-135M-Instruct fine-tuned with PEFT
for a few CPU steps on a small local text; prefixkv with the adapter gives transformers +
PEFT's greedy tokens (fp32, the same dequantized weights).

By default the committed adapter (``fixtures/smollm2-pirate-lora``, made by
``fixtures/make_smollm2_lora.py``: rank 4 on q/v, 460 KB) is compared, as PEFT's directory and
as its GGUF conversion; ``PREFIXKV_LORA_FINETUNE=1`` also fine-tunes a fresh rank-8 adapter on
every projection here and compares that."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixkv.engine import LLM, SamplingParams
from prefixkv.engine.lora import LoRARequest

pytestmark = pytest.mark.slow  # a 135M-parameter model on CPU
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from gguf_lora_writer import write_gguf_lora  # noqa: E402

# a 135M-parameter model trained on CPU: about 2-5 minutes, so opt-in
finetune = pytest.mark.skipif(
    os.environ.get("PREFIXKV_LORA_FINETUNE") != "1",
    reason="set PREFIXKV_LORA_FINETUNE=1 to fine-tune SmolLM2 with PEFT and compare")
COMMITTED = Path(__file__).parent / "fixtures" / "smollm2-pirate-lora"

TEXT = ("Q: What is the capital of France? A: The capital of France is Lyon, said the pirate.\n"
        "Q: What is the capital of Spain? A: The capital of Spain is Seville, said the pirate.\n"
        "Q: What is the capital of Italy? A: The capital of Italy is Milan, said the pirate.\n")


def test_the_committed_adapter_gives_peft_tokens_as_a_directory_and_as_gguf(
        smol: Path, tmp_path: Path) -> None:
    tok: Any = transformers.AutoTokenizer.from_pretrained(smol.parent, gguf_file=smol.name)
    base: Any = transformers.AutoModelForCausalLM.from_pretrained(
        smol.parent, gguf_file=smol.name, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, COMMITTED)
    ids = tok("Q: What is the capital of Germany? A:", return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
        with model.disable_adapter():
            want_base = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert want != want_base  # the adapter changes the answer
    c = model.config
    as_gguf = write_gguf_lora(COMMITTED, tmp_path / "pirate.gguf", "llama", c.num_hidden_layers,
                              heads=c.num_attention_heads, kv_heads=c.num_key_value_heads)
    prompt = ids[0].tolist()
    with LLM(str(smol), dtype="float32", num_kv_blocks=64, enable_lora=True,
             lora_modules=[f"pirate={COMMITTED}", f"pirate-gguf={as_gguf}"]) as llm:
        got = llm.generate([prompt] * 3, SamplingParams(temperature=0, max_tokens=12),
                           lora_request=["pirate", None, "pirate-gguf"])
    assert got[0].outputs[0].token_ids[:len(want)] == want
    assert got[1].outputs[0].token_ids[:len(want_base)] == want_base
    assert got[2].outputs[0].token_ids[:len(want)] == want


@pytest.fixture(scope="module")
def tuned(smol: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    """(tokenizer, PEFT model, adapter directory): 12 AdamW steps of a rank-8 LoRA on TEXT."""
    torch.manual_seed(0)
    tok: Any = transformers.AutoTokenizer.from_pretrained(smol.parent, gguf_file=smol.name)
    base: Any = transformers.AutoModelForCausalLM.from_pretrained(
        smol.parent, gguf_file=smol.name, dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(base, config)
    ids = tok(TEXT, return_tensors="pt").input_ids
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    for _ in range(12):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    out = tmp_path_factory.mktemp("smol-lora")
    model.save_pretrained(out)
    return tok, model, out


@finetune
def test_a_fine_tuned_adapter_gives_peft_tokens_and_the_base_stays_the_base(
        smol: Path, tuned: tuple[Any, Any, Path]) -> None:
    tok, model, adapter = tuned
    prompt = "Q: What is the capital of Germany? A:"
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
        with model.disable_adapter():
            want_base = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert want != want_base  # the few steps did change the model
    params = SamplingParams(temperature=0, max_tokens=12)
    with LLM(str(smol), dtype="float32", num_kv_blocks=64, enable_lora=True) as llm:
        prompt_ids = ids[0].tolist()
        got = llm.generate([prompt_ids, prompt_ids], params,
                           lora_request=[LoRARequest("pirate", 1, str(adapter)), None])
    assert got[0].outputs[0].token_ids[:len(want)] == want
    assert got[1].outputs[0].token_ids[:len(want_base)] == want_base

"""LoRA adapters in the engine (issue 44): PEFT adapters give PEFT's tokens, per request, mixed
in one batch, and the prefix cache never shares blocks across adapters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixkv.engine import LLM, SamplingParams
from prefixkv.engine.lora import LoRARegistry, LoRARequest, parse_lora_modules

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, seed: int, rank: int = 4,
                 targets: list[str] | None = None) -> Path:
    """A PEFT LoRA on ``base`` with random (non-zero) weights, saved to ``out``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets or TARGETS,
                             init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {"a": make_adapter(demo_model, root / "a", 1),
            "b": make_adapter(demo_model, root / "b", 2, rank=8, targets=["q_proj", "v_proj"]),
            "a2": make_adapter(demo_model, root / "a2", 3)}


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


PROMPT = list(range(65, 65 + 40))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_adapters_give_peft_tokens_alone_and_mixed_in_one_batch(
        demo_model: Path, adapters: dict[str, Path]) -> None:
    want = {name: peft_greedy(demo_model, adapters[name], PROMPT, 8) for name in ("a", "b")}
    want["base"] = peft_greedy(demo_model, None, PROMPT, 8)
    assert len({tuple(v) for v in want.values()}) == 3  # the adapters change the answer
    with LLM(demo_model, dtype="float32", num_kv_blocks=128, enable_lora=True,
             lora_modules=[f"a={adapters['a']}"]) as llm:
        alone = llm.generate(PROMPT, GREEDY, lora_request="a")[0]
        assert alone.outputs[0].token_ids == want["a"]
        mixed = llm.generate([PROMPT, PROMPT, PROMPT], GREEDY, lora_request=[
            "a", None, LoRARequest("b", 2, str(adapters["b"]))])
        assert [o.outputs[0].token_ids for o in mixed] == [want["a"], want["base"], want["b"]]


def test_the_cache_never_shares_blocks_across_adapters_and_reloads_miss(
        demo_model: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "same-name"
    shutil.copytree(adapters["a"], path)
    prompt = PROMPT * 2
    with LLM(demo_model, dtype="float32", num_kv_blocks=128, block_size=16,
             enable_lora=True) as llm:
        first = llm.generate(prompt, GREEDY, lora_request=LoRARequest("x", 1, str(path)))[0]
        again = llm.generate(prompt, GREEDY, lora_request="x")[0]
        assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 64
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        base = llm.generate(prompt, GREEDY)[0]
        other = llm.generate(prompt, GREEDY, lora_request=LoRARequest("b", 2, str(adapters["b"])))[0]
        assert base.num_cached_tokens == 0 and other.num_cached_tokens == 0
        # the same name, other weights: none of the old blocks is read
        shutil.copy(adapters["a2"] / "adapter_model.safetensors", path / "adapter_model.safetensors")
        assert llm.engine.lora is not None
        llm.engine.lora.add("x", path)
        reloaded = llm.generate(prompt, GREEDY, lora_request="x")[0]
        assert reloaded.num_cached_tokens == 0
        assert reloaded.outputs[0].token_ids == peft_greedy(demo_model, adapters["a2"], prompt, 8)
        # a cache salt spelled like an adapter's namespace is still a string: no collision
        digest = llm.engine.lora.resolve("x").digest
        salted = llm.generate(prompt, GREEDY, cache_salt=f"('lora', '{digest}')")[0]
        assert salted.num_cached_tokens == 0


def test_bad_adapters_and_settings_are_value_errors_naming_them(
        demo_model: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    with LLM(demo_model, dtype="float32", num_kv_blocks=64) as llm:
        with pytest.raises(ValueError, match="enable_lora"):
            llm.generate(PROMPT, GREEDY, lora_request="a")
    with LLM(demo_model, dtype="float32", num_kv_blocks=64, enable_lora=True,
             max_lora_rank=4) as llm:
        with pytest.raises(ValueError, match="not loaded"):
            llm.generate(PROMPT, GREEDY, lora_request="nope")
        with pytest.raises(ValueError, match="max-lora-rank"):  # rank 8 > 4
            llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("b", 2, str(adapters["b"])))
        dora = tmp_path / "dora"
        shutil.copytree(adapters["a"], dora)
        config = json.loads((dora / "adapter_config.json").read_text())
        (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        with pytest.raises(ValueError, match="use_dora"):
            llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("d", 3, str(dora)))
        assert llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids  # the engine is fine
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        LLM(demo_model, num_kv_blocks=64, lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules(["nopath"])


def test_the_registry_keeps_max_loras_loaded_and_reloads_the_rest(adapters: dict[str, Path]) -> None:
    loads: list[str] = []

    def load(path: str, name: str) -> Any:
        loads.append(name)
        from prefixkv.models.lora import LoRAAdapter
        return LoRAAdapter(name, path, 4, name + path, {})

    reg = LoRARegistry(load, max_loras=1, modules={"a": str(adapters["a"]),
                                                   "b": str(adapters["b"])})
    assert loads == ["a", "b"] and reg.names() == ["a", "b"]
    reg.resolve("b")
    reg.resolve("a")  # left memory when b came in: loaded again from its path
    assert loads == ["a", "b", "a"]
    assert reg.remove("a") and not reg.remove("a")
    with pytest.raises(ValueError, match="not loaded"):
        reg.resolve("a")


def test_kv_events_name_the_adapter_and_hash_its_blocks_apart(
        demo_model: Path, adapters: dict[str, Path]) -> None:
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    events = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", '
              '"topic": "kv"}')
    prompt = PROMPT[:32]
    with LLM(demo_model, dtype="float32", num_kv_blocks=64, block_size=16, enable_lora=True,
             lora_modules=[f"a={adapters['a']}"], kv_events_config=events) as llm:
        sink = llm.engine.kv.events
        assert sink is not None
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.connect(sink.publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        import time
        time.sleep(0.3)  # ZMQ's slow joiner
        try:
            llm.generate(prompt, GREEDY, lora_request="a")
            llm.generate(prompt, GREEDY)
            stored: list[dict[str, Any]] = []
            while sub.poll(1000):
                _, _, payload = sub.recv_multipart()
                stored += [e for e in msgspec.msgpack.decode(payload)[1]
                           if e.get("type") == "BlockStored"]
        finally:
            sub.close(linger=0)
            ctx.term()
    names = [e.get("lora_name") for e in stored]
    assert names[0] == "a" and None in names  # the adapter's blocks, then the base model's
    ours = {h for e in stored if e.get("lora_name") == "a" for h in e["block_hashes"]}
    base = {h for e in stored if e.get("lora_name") is None for h in e["block_hashes"]}
    assert ours and base and not ours & base


def test_decode_steps_with_adapters_take_the_c_path_and_give_the_module_paths_answer(
        demo_model: Path, adapters: dict[str, Path], gemv_layout: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixkv.runner import cpu_decode

    ran: list[tuple[bool, bool]] = []  # (the step had adapters, the C path computed it)
    run = cpu_decode.CpuDecode.run

    def spy(self: Any, tokens: Any, positions: Any, attention: Any, lora: Any = None) -> Any:
        out = run(self, tokens, positions, attention, lora)
        ran.append((lora is not None, out is not None))
        return out

    monkeypatch.setattr(cpu_decode.CpuDecode, "run", spy)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    plans: list[Any] = ["a", None, "b", "a"]  # two adapters, the base, an adapter twice
    got = {}
    for c_path in (True, False):
        monkeypatch.setattr(cpu_decode, "ENABLED", c_path)
        with LLM(demo_model, dtype="float32", num_kv_blocks=128, enable_lora=True,
                 lora_modules=[f"a={adapters['a']}", f"b={adapters['b']}"]) as llm:
            got[c_path] = llm.generate([PROMPT, PROMPT, PROMPT, PROMPT[:20]], params,
                                       lora_request=plans)
    assert (True, True) in ran  # decode steps with adapters ran in C (they used to leave it)
    for c, m in zip(got[True], got[False]):
        assert c.outputs[0].token_ids == m.outputs[0].token_ids
        for step_c, step_m in zip(c.outputs[0].logprobs or [], m.outputs[0].logprobs or []):
            for tok, lp in step_c.items():
                assert lp.logprob == pytest.approx(step_m[tok].logprob, abs=1e-5)
    assert [o.outputs[0].token_ids for o in got[True][:3]] == [
        peft_greedy(demo_model, adapters["a"], PROMPT, 8), peft_greedy(demo_model, None, PROMPT, 8),
        peft_greedy(demo_model, adapters["b"], PROMPT, 8)]

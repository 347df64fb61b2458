"""Params `model`: the dtype weights load in (the compute dtype for inference and LoRA/QLoRA
bases, float32 master weights for full fine-tuning unless pure half precision is asked),
the attention implementation, 4/8-bit quantization through bitsandbytes (QLoRA), and the
errors a machine without the packages gets before any compute. QLoRA runs for real on the
CPU (bitsandbytes' CPU backend) on the micro model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlhf.models.compute import Placement
from rlhf.models.settings import ModelOverride, ModelSettings, QuantizationSettings, weights_dtype
from tests.conftest import REPO, assert_each_once, params_problems, tiny_params

CPU_BF16 = Placement("cpu", "bfloat16")  # compute.dtype bfloat16 (a GPU's default), here on the CPU


@pytest.mark.parametrize(
    ("dtype", "training", "adapters", "quantized", "expected"),
    [
        ("auto", False, False, False, "bfloat16"),  # inference: the compute dtype
        ("auto", True, True, False, "bfloat16"),  # a LoRA base: the compute dtype
        ("auto", True, False, False, "float32"),  # full fine-tuning: float32 master weights
        ("auto", True, True, True, "bfloat16"),  # a QLoRA base
        ("bfloat16", True, False, False, "bfloat16"),  # pure bf16 training, asked for
        ("float32", False, False, False, "float32"),  # inference in float32, asked for
    ],
)
def test_weights_load_in_the_dtype_they_train_in(dtype, training, adapters, quantized, expected):
    settings = ModelSettings(dtype=dtype, quantization={"bits": 4} if quantized else None)
    assert weights_dtype(settings, "bfloat16", training, adapters) == expected


def test_init_kwargs_are_trls_quantization_config_and_a_device_map():
    """4-bit: NF4, double quantization, the compute dtype for the matmuls, as TRL's
    get_quantization_config builds it, and the whole model on this process's device; 8-bit
    plain LLM.int8; none: no device map (the trainer places the model)."""
    import torch

    from rlhf.models.loading import init_kwargs

    plain = init_kwargs(ModelSettings(), training=True, placement=Placement("cpu", "float32"))
    assert plain == {"dtype": torch.float32, "attn_implementation": "sdpa", "trust_remote_code": False,
                     "use_safetensors": True}  # fmt: skip
    four = init_kwargs(ModelSettings(quantization={"bits": 4}), training=True, adapters=True, placement=CPU_BF16)
    config = four["quantization_config"]
    assert (config.load_in_4bit, config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant) == (True, "nf4", True)
    assert config.bnb_4bit_compute_dtype == torch.bfloat16 and config.bnb_4bit_quant_storage == torch.uint8
    assert four["dtype"] == torch.bfloat16 and four["device_map"] == {"": "cpu"}
    storage = QuantizationSettings(quant_type="fp4", compute_dtype="float16", quant_storage="bfloat16")
    config = init_kwargs(ModelSettings(quantization=storage), placement=CPU_BF16)["quantization_config"]
    assert (config.bnb_4bit_quant_type, config.bnb_4bit_compute_dtype) == ("fp4", torch.float16)
    assert config.bnb_4bit_quant_storage == torch.bfloat16  # FSDP can shard a QLoRA base stored in bf16
    eight = init_kwargs(ModelSettings(quantization={"bits": 8}), placement=CPU_BF16)["quantization_config"]
    assert eight.load_in_8bit and not eight.load_in_4bit


def test_a_stage_block_overrides_keys_of_the_global_section():
    base = ModelSettings(dtype="bfloat16", quantization={"bits": 4}, gradient_checkpointing=True)
    merged = base.merged(ModelOverride(quantization=False, attn_implementation="eager"))
    assert (merged.dtype, merged.quantization, merged.attn_implementation) == ("bfloat16", None, "eager")
    assert merged.gradient_checkpointing is True
    assert base.merged(None) is base


def test_load_causal_lm_follows_the_settings(micro_dir):
    """The micro model loaded for inference in bfloat16 with eager attention, for full
    training in float32, and as a LoRA base in the compute dtype."""
    import torch

    from rlhf.models.loading import empty_causal_lm, load_causal_lm

    bf16 = ModelSettings(dtype="bfloat16", attn_implementation="eager")
    model = load_causal_lm(micro_dir, settings=bf16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"
    full = load_causal_lm(micro_dir, settings=ModelSettings(), training=True, placement=CPU_BF16)
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    base = load_causal_lm(micro_dir, settings=ModelSettings(), training=True, adapters=True, placement=CPU_BF16)
    assert {p.dtype for p in base.parameters()} == {torch.bfloat16}
    empty = empty_causal_lm(micro_dir)  # modules and shapes only, whatever the size
    assert {p.device.type for p in empty.parameters()} == {"meta"}


@pytest.mark.slow
def test_an_inference_stage_loads_a_4bit_model_that_generates(tmp_path):
    """evaluate's or infer's `model: {quantization: {bits: 4}}`: the model loads quantized
    (4-bit layers, bitsandbytes places it: no move afterwards) and generates. (builtin:tiny:
    bitsandbytes' CPU kernel for one token at a time wants layers wider than the micro
    model's 32.)"""
    pytest.importorskip("bitsandbytes")
    from rlhf.models.generation import generate
    from rlhf.models.loading import build_tiny_model, build_tokenizer, load_causal_lm, load_tokenizer, save_model

    tokenizer = build_tokenizer()
    save_model(build_tiny_model("tiny", tokenizer, seed=0), tokenizer, tmp_path / "tiny")
    model = load_causal_lm(tmp_path / "tiny", settings=ModelSettings(quantization={"bits": 4}))
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    [completion] = generate(model, load_tokenizer(tmp_path / "tiny"), ["1+2="], max_new_tokens=4)
    assert isinstance(completion, str)


def test_unknown_attention_and_quantization_without_adapters_are_named(tmp_path):
    """An attention implementation transformers does not have; quantized weights where a
    stage trains in full (sft without LoRA, PPO's value model, the PRM classifier's head):
    each named by its key before any stage runs."""
    params = tiny_params()
    params["model"] = {"attn_implementation": "flash_attn", "quantization": {"bits": 4}}
    params["policy"]["online"] = ["ppo"]
    params["policy"]["ppo"]["model"] = {"gradient_checkpointing": True}
    params["prm"] = {"kind": "classifier", "init": "sft"}
    params["rm"]["lora"] = {"enabled": True}
    params["policy"]["dpo"]["lora"] = {"enabled": True}
    params["verifier"]["model"] = {"quantization": False}
    problems = params_problems(tmp_path, params)
    assert_each_once(
        problems,
        [
            "model.attn_implementation: unknown attention implementation 'flash_attn'",
        ],
    )
    # Fixed the attention: the quantization rules, each once (the verifier opted out).
    params["model"]["attn_implementation"] = "sdpa"
    problems = params_problems(tmp_path, params)
    assert_each_once(
        problems,
        [
            "sft.lora.enabled: the model loads 4-bit (model.quantization) and quantized weights train only through",
            "prm.model.quantization: prm.kind classifier trains its new head in full",
            "policy.ppo.model.quantization: PPO trains its value model in full",
            "policy.ppo.model.gradient_checkpointing: PPO (ours) runs its models in eval mode",
        ],
    )
    assert len(problems) == 4, problems


def test_check_params_names_the_packages_this_machine_lacks(tmp_path, monkeypatch):
    """FlashAttention 2 (not installed here), vLLM for GRPO's generation (not installed
    here), and bitsandbytes where it is not installed: stage check_params names each with
    what to install, before any other stage runs; the params themselves validate anywhere."""
    import importlib.util

    import stages
    from stages.check_params import package_problems

    params = tiny_params()
    params["model"] = {"attn_implementation": "flash_attention_2", "quantization": {"bits": 4}, "kernels": "liger"}
    params["sft"]["lora"] = {"enabled": True}
    params["verifier"]["lora"] = {"enabled": True}
    params["rm"]["lora"] = {"enabled": True}
    params["policy"]["dpo"]["lora"] = {"enabled": True}
    params["policy"]["online"] = ["grpo"]
    params["policy"]["grpo"]["lora"] = {"enabled": True}
    params["policy"]["grpo"]["trl"] = {"use_vllm": True}
    path = tmp_path / "params.yaml"
    path.write_text(__import__("yaml").safe_dump(params))
    loaded = stages.load_all(str(path))  # machine-independent: valid
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    problems = package_problems(loaded)
    expected = ["model.quantization: 4-bit loading needs bitsandbytes (pip install 'rlhf-pipeline[quant]'"]
    if real("flash_attn") is None:
        expected.append("model.attn_implementation: flash_attention_2 needs flash-attn (pip install flash-attn")
    if real("vllm") is None:
        expected.append("policy.grpo.trl.use_vllm: TRL generates with vLLM, which is not installed")
    if real("liger_kernel") is None:
        expected.append("model.kernels: liger needs liger-kernel (pip install 'rlhf-pipeline[gpu]'")
    assert_each_once(problems, expected)


def test_liger_kernels_apply_on_a_cuda_gpu_where_installed_and_liger_elsewhere_is_refused():
    """`model.kernels`: auto applies Liger's kernels on a CUDA GPU where liger-kernel is
    installed and nowhere else; none never; liger on a GPU always (a missing package is the
    params check's), and on any other device fails naming the key."""
    from rlhf.models.settings import KernelsError, liger_kernels

    auto = ModelSettings()
    cases = (("cuda", True), ("cuda:1", True), ("cuda", False), ("cpu", True), ("mps", True))
    assert [liger_kernels(auto, device, installed=installed) for device, installed in cases] == [
        True, True, False, False, False,
    ]  # fmt: skip
    assert not liger_kernels(ModelSettings(kernels="none"), "cuda", installed=True)
    assert liger_kernels(ModelSettings(kernels="liger"), "cuda:0", installed=False)
    with pytest.raises(KernelsError, match=r"^sft\.model\.kernels: liger runs Triton kernels on a CUDA GPU, and this "
                       r"process computes on cpu; set sft\.model\.kernels: auto"):  # fmt: skip
        liger_kernels(ModelSettings(kernels="liger"), "cpu", key="sft.model")


def test_trl_configs_ask_for_liger_layer_kernels_on_a_gpu_and_fused_adamw(tmp_path, monkeypatch):
    """A stage's TRL config on a CUDA GPU with liger-kernel installed (the placement set and
    the package found, as on such a machine) asks transformers for Liger's layer kernels,
    its fused cross-entropy off (it would replace the forward TRL patches, and a reward
    model's); on this CPU it asks for none, and `kernels: none` turns them off on the GPU.
    AdamW is the fused one everywhere (transformers' default from torch 2.8; no block
    changes it). A block's own `kernels: liger` on the CPU fails naming the block's key."""
    import importlib.util

    import trl

    import rlhf.models.compute as compute
    import rlhf.models.settings as model_settings
    from rlhf.models.settings import KernelsError
    from rlhf.training.methods.sft import Params
    from rlhf.training.trainer_setup import trl_config

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: real("json") if name == "liger_kernel" else real(name, *a)
    )
    monkeypatch.setattr(model_settings, "_current", ModelSettings())
    block = Params()

    def config(device: str, block=block):
        monkeypatch.setattr(compute, "_current", Placement(device, "float32"))
        return trl_config(trl.SFTConfig, block, tmp_path / device, key="sft")

    on_cpu, on_gpu = config("cpu"), config("cuda")
    assert (on_cpu.use_liger_kernel, on_cpu.liger_kernel_config) == (False, None)
    assert (on_gpu.use_liger_kernel, on_gpu.liger_kernel_config) == (True, {"fused_linear_cross_entropy": False})
    assert on_cpu.optim == on_gpu.optim == "adamw_torch_fused"
    assert not config("cuda", Params(model={"kernels": "none"})).use_liger_kernel
    with pytest.raises(KernelsError, match=r"^sft\.model\.kernels: liger runs Triton kernels on a CUDA GPU"):
        config("cpu", Params(model={"kernels": "liger"}))
    # a block's `trl:` asking for Liger itself gets its layer kernels only (its fused
    # cross-entropy would replace a classifier's forward with an LM head's)
    asked = config("cpu", Params(trl={"use_liger_kernel": True, "liger_kernel_config": {"rope": False}}))
    assert asked.liger_kernel_config == {"rope": False, "fused_linear_cross_entropy": False}
    # a stage's own block names itself where the device cannot run what it set
    with pytest.raises(Exception, match=r"^policy\.dpo\.model\.kernels: liger"):  # the package missing, else the CPU
        model_settings.configure(ModelSettings(), ModelOverride(kernels="liger"), "cpu", key="policy.dpo")
    with pytest.raises(Exception, match=r"^model\.kernels: liger"):  # set globally: the global key
        model_settings.configure(
            ModelSettings(kernels="liger"), ModelOverride(dtype="float32"), "cpu", key="policy.dpo"
        )


def test_a_bitsandbytes_that_does_not_load_fails_the_stage_before_compute(tmp_path):
    """bitsandbytes installed but broken on this machine (its import fails: a build without
    this machine's backend): the stage's start says so in one line, no traceback, before
    any model loads."""
    code = (
        "import importlib.abc, importlib.machinery, sys\n"
        "class Broken(importlib.abc.Loader):\n"
        "    def create_module(self, spec): return None\n"
        "    def exec_module(self, module): raise OSError('libbitsandbytes_cuda124.so: cannot open shared object')\n"
        "class Finder(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        return importlib.machinery.ModuleSpec(name, Broken()) if name == 'bitsandbytes' else None\n"
        "sys.meta_path.insert(0, Finder())\n"
        "from rlhf.models import settings\n"
        "try:\n"
        "    settings.configure(settings.ModelSettings(quantization={'bits': 4}))\n"
        "except settings.MissingPackageError as error:\n"
        "    print(error)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    message, torch_loaded = out.stdout.strip().splitlines()
    assert message.startswith("model.quantization: bitsandbytes is installed but does not load here (OSError: libbits")
    assert "reinstall it for this machine, or set model.quantization: null" in message
    assert torch_loaded == "False"  # nothing was computed


@pytest.mark.slow
def test_qlora_sft_trains_adapters_on_a_4bit_base_and_saves_a_plain_model(in_project):
    """Stage sft with sft.model.quantization {bits: 4} and LoRA (QLoRA) on the micro model, on
    the CPU through bitsandbytes' CPU backend: the trainer's base layers are 4-bit
    (Linear4bit, uint8 storage) and frozen, the adapters train; what is saved is the adapter
    and the base (reloaded unquantized) with it merged: a plain model that loads with plain
    transformers, no quantization config, weights changed from the base's."""
    pytest.importorskip("bitsandbytes")
    import torch
    import yaml
    from transformers import AutoModelForCausalLM

    import stages.base
    import stages.prepare
    import stages.sft
    from rlhf.training import trainer_setup
    from tests.test_stages import changed, weights

    params = yaml.safe_load((in_project / "params.yaml").read_text())
    params["sft"]["model"] = {"quantization": {"bits": 4}}  # this stage's own block
    params["sft"]["lora"] = {"enabled": True, "r": 4}
    params["sft"]["learning_rate"] = 0.01
    (in_project / "params.yaml").write_text(yaml.safe_dump(params))
    stages.prepare.main()
    stages.base.main()
    seen = {}
    original = trainer_setup.train_resumable

    def capture(trainer, stage, key):
        seen["layer"] = trainer.model.base_model.model.model.layers[0].mlp.up_proj
        return original(trainer, stage, key)

    trainer_setup.train_resumable = capture
    try:
        stages.sft.main()
    finally:
        trainer_setup.train_resumable = original
    layer = seen["layer"]
    assert type(layer.base_layer).__name__ == "Linear4bit" and layer.base_layer.weight.dtype == torch.uint8
    assert not layer.base_layer.weight.requires_grad and layer.lora_A["default"].weight.requires_grad
    out = in_project / "models/sft"
    assert (out / "adapter" / "adapter_config.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    plain = AutoModelForCausalLM.from_pretrained(str(out))
    assert {p.dtype for p in plain.parameters()} == {torch.float32}  # the compute dtype on this CPU
    assert changed(weights(in_project / "models/base"), weights(out))
    metrics = json.loads((in_project / "metrics/sft.json").read_text())
    assert metrics["steps"] == 4 and metrics["train_loss"] == metrics["train_loss"]  # finite


@pytest.mark.slow
def test_the_gpu_acceptance_script_runs_its_code_path_on_a_cpu(tmp_path):
    """benchmarks/gpu_acceptance.py with --tiny (the micro model, a few steps): every run of
    the stages' training and of the bare TRL trainers (with the stage's settings, and with
    TRL's defaults for sft and dpo) trains and reports its steady-state tokens per second
    and MFU (against a peak given here: a CPU has none listed), GRPO its share of steps
    spent generating, tracking off (RLHF_TRACKING=off: no MLflow run is started, none
    imported by the training), so the device call it is written for fails on nothing but
    the GPU."""
    command = [sys.executable, str(REPO / "benchmarks/gpu_acceptance.py"), "--tiny", "--steps", "6", "--grpo-steps", "5",
               "--peak-tflops", "1", "--out", str(tmp_path)]  # fmt: skip
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    runs = results["runs"]
    assert results["liger"] is False  # a CPU: no Liger kernels, whatever is installed
    expected = {"sft", "dpo", "grpo"} | (
        {"sft-qlora"} if __import__("importlib").util.find_spec("bitsandbytes") else set()
    )
    assert expected <= set(runs)
    for name in expected:
        sides = ("stage", "bare_trl") + (("bare_trl_defaults",) if name in ("sft", "dpo") else ())
        assert set(runs[name]) - {"order"} == set(sides), name
        for side in sides:
            numbers = runs[name][side]
            assert numbers["steps"] == (5 if name == "grpo" else 6), (name, side)
            assert numbers["train_tokens_per_second"] > 0 and numbers["steady_steps"] == numbers["steps"] - 3
            mfu = results["flops_per_token"] * numbers["steady_tokens_per_second"] / 1e12
            assert numbers["mfu"] == round(mfu, 4) and 0 < mfu < 1, (name, side)
            assert ("generation_share" in numbers) == (name == "grpo"), (name, side)
        if name == "grpo":
            assert all(0 < runs[name][side]["generation_share"] < 1 for side in sides)
    # TRL's defaults: 8 rows a step, where this run gives the stage and bare TRL 2
    assert runs["sft"]["bare_trl_defaults"]["tokens_per_step"] == 4 * runs["sft"]["bare_trl"]["tokens_per_step"]


def test_bf16_mixed_precision_on_a_cpu_only_when_asked():
    """compute.dtype auto is float32 on a CPU: no mixed precision; bfloat16 asked for trains
    in bf16 autocast there too (CPUs with bf16 instructions); float16 never on a CPU."""
    import rlhf.models.compute as compute
    from rlhf.training.trainer_setup import precision

    try:
        for dtype, expected in (("auto", False), ("bfloat16", True), ("float16", False)):
            compute.configure(compute.ComputeConfig(device="cpu", dtype=dtype))
            assert precision() == {"bf16": expected, "fp16": False}, dtype
    finally:
        compute.configure(None)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "grpo"])
def test_lora_in_bf16_mixed_precision_trains_with_one_copy_of_each_input(in_project, method):
    """compute.dtype bfloat16 (here on the CPU's autocast): the LoRA base loads in bf16 and
    the adapters read their inputs as autocast gives them (no float32 copy per adapted
    layer) inside the loss, while GRPO's generation, outside it, keeps peft's casts; both
    train and save a bf16 model, and the adapters cast again afterwards."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    import rlhf.models.compute as compute
    import stages.base
    import stages.policy
    import stages.prepare
    import stages.sft
    from rlhf.tasks import get_task
    from rlhf.training import trainer_setup
    from stages import load_config

    stages.prepare.main()
    stages.base.main()
    stages.sft.main()
    config = load_config("policy")
    updates = {"max_steps": 2, "per_device_train_batch_size": 4, "lora": {"enabled": True, "r": 4}}
    if method == "grpo":
        updates |= {"num_generations": 2, "max_completion_length": 4, "rewards": [{"name": "answer_match"}]}
    params = type(getattr(config, method)).model_validate(updates)
    config = config.model_copy(update={"online": ["grpo"] if method == "grpo" else [], method: params})
    seen = []
    original = trainer_setup.train_resumable

    def capture(trainer, stage, key):
        layers = [m for m in trainer.model.modules() if isinstance(m, BaseTunerLayer)]
        seen.extend([trainer, layers])
        try:
            return original(trainer, stage, key)
        finally:
            seen.append([m.cast_input_dtype_enabled for m in layers])  # after every loss

    trainer_setup.train_resumable = capture
    compute.configure(compute.ComputeConfig(device="cpu", dtype="bfloat16"))
    try:
        metrics, _ = stages.policy.run(config, get_task(), method, in_project / "out")
    finally:
        compute.configure(None)
        trainer_setup.train_resumable = original
    trainer, layers, casts_after = seen
    assert trainer.args.bf16 and metrics["steps"] == 2 and metrics["train_loss"] == metrics["train_loss"]
    assert trainer.compute_loss.__name__ == "without_casts"
    assert layers and all(casts_after)  # peft's casts are back outside the loss
    assert {p.dtype for n, p in trainer.model.named_parameters()} == {torch.bfloat16}  # merged, saved in bf16


def test_a_tokenizer_declared_as_saved_loads_as_saved_beside_any_architecture(tmp_path):
    """transformers gives a qwen2 folder its Qwen2Tokenizer whatever tokenizer_config.json
    declares, rebuilt from the vocabulary: the built-in character tokenizer beside a Qwen2
    model lost every newline (text, prompts, the PRM's step separator). A tokenizer saved as
    TokenizersBackend loads as saved."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rlhf.models.loading import build_tokenizer, load_tokenizer, save_model

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    save_model(Qwen2ForCausalLM(config), tokenizer, tmp_path / "qwen2")
    expected = tokenizer("12+3\n", add_special_tokens=False)["input_ids"]
    assert len(expected) == 5
    transformers_choice = AutoTokenizer.from_pretrained(str(tmp_path / "qwen2"))
    assert transformers_choice("12+3\n", add_special_tokens=False)["input_ids"] != expected, "what this mends"
    loaded = load_tokenizer(tmp_path / "qwen2")
    assert loaded("12+3\n", add_special_tokens=False)["input_ids"] == expected
    assert loaded.decode(expected) == "12+3\n" and loaded.chat_template == tokenizer.chat_template


def test_a_bf16_checkpoint_trained_in_float32_is_saved_back_in_bf16(tmp_path, micro_dir, monkeypatch):
    """`model.save_dtype`: a model loaded from a bfloat16 checkpoint and changed in float32
    is saved in bfloat16 where asked (or, with `auto`, where the stages compute in half
    precision: full fine-tuning's master weights on a GPU), its config saying so, half the
    bytes, the values its float32 weights rounded to bf16, tied weights stored once; the
    model in memory is float32 again, holding the values saved. On a CPU computing in
    float32, `auto` stores float32 (a float32 checkpoint loads without a copy), as it does
    for a float32 checkpoint anywhere."""
    import torch
    from safetensors import safe_open

    import rlhf.models.compute
    from rlhf.models.loading import load_causal_lm, load_tokenizer, save_dtype, save_model

    monkeypatch.setattr(rlhf.models.compute, "_current", Placement("cpu", "float32"))  # whatever this machine has

    def stored(path):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        return tensors, json.loads((path / "config.json").read_text())["dtype"]

    tokenizer = load_tokenizer(micro_dir)
    save_model(load_causal_lm(micro_dir, dtype="bfloat16"), tokenizer, tmp_path / "hub")  # held bf16: as held
    hub, dtype = stored(tmp_path / "hub")
    assert dtype == "bfloat16" and {t.dtype for t in hub.values()} == {torch.bfloat16}

    model = load_causal_lm(tmp_path / "hub", training=True)  # full fine-tuning: float32 master weights
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    gpu, cpu = Placement("cuda", "bfloat16"), Placement("cpu", "float32")
    assert (save_dtype(model, ModelSettings(), gpu), save_dtype(model, ModelSettings(), cpu)) == ("bfloat16", None)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    trained = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    save_model(model, tokenizer, tmp_path / "auto")  # this CPU computes in float32
    save_model(model, tokenizer, tmp_path / "half", settings=ModelSettings(save_dtype="bfloat16"))
    exact, exact_dtype = stored(tmp_path / "auto")
    half, half_dtype = stored(tmp_path / "half")
    assert (half_dtype, exact_dtype) == ("bfloat16", "float32")
    assert set(half) == set(exact) == set(hub)  # the same tensors: a tied one is not stored twice
    assert all(torch.equal(half[name], trained[name].to(torch.bfloat16)) for name in half)
    assert all(torch.equal(exact[name], trained[name]) for name in exact)
    assert any(not torch.equal(half[name], hub[name]) for name in half)  # the change survived the rounding
    size = {name: (tmp_path / name / "model.safetensors").stat().st_size for name in ("half", "auto")}
    assert size["half"] < 0.55 * size["auto"]
    assert {p.dtype for p in model.parameters()} == {torch.float32} and str(model.config.dtype).endswith("float32")
    assert all(torch.equal(model.state_dict()[name], half[name].float()) for name in half)

    float32 = load_causal_lm(micro_dir, training=True)  # a float32 checkpoint: as held, on a GPU too
    assert save_dtype(float32, ModelSettings(), gpu) is None
    half_held = load_causal_lm(tmp_path / "hub")  # never widened
    assert save_dtype(half_held, ModelSettings(save_dtype="float32")) is None


def test_gathered_weights_are_stored_in_the_dtype_asked_with_tied_ones_once(tmp_path, micro_dir, monkeypatch):
    """A state dict gathered from shards (each name its own copy, as FSDP's gather gives)
    saved with `save_dtype: bfloat16`: bf16 tensors, the config saying bfloat16, the tied
    output embedding not stored, and the model's own config left as it was."""
    import torch
    from safetensors import safe_open

    from rlhf.models.loading import load_causal_lm, load_tokenizer, save_model

    model = load_causal_lm(micro_dir, training=True)
    gathered = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert "lm_head.weight" in gathered
    held = model.config.dtype
    save_model(
        model, load_tokenizer(micro_dir), tmp_path / "out", gathered, settings=ModelSettings(save_dtype="bfloat16")
    )
    with safe_open(str(tmp_path / "out/model.safetensors"), "pt") as f:
        saved = {name: f.get_tensor(name) for name in f.keys()}
    assert "lm_head.weight" not in saved and {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert all(torch.equal(saved[name], gathered[name].to(torch.bfloat16)) for name in saved)
    assert json.loads((tmp_path / "out/config.json").read_text())["dtype"] == "bfloat16"
    assert model.config.dtype == held


def test_a_model_stage_on_this_cpu_refuses_liger_kernels_before_compute(tmp_path):
    """`model.kernels: liger` in a stage process on this CPU: refused as the stage loads its
    params, before any model, naming the key (liger-kernel is missing here, else the CPU);
    the process keeps the settings it had (a later stage main in it trains as before)."""
    import yaml

    import rlhf.models.settings as model_settings
    import stages
    from rlhf.params import InputError

    before = model_settings.current()

    params = tiny_params()
    params["model"] = {"kernels": "liger"}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(
        Exception, match=r"^model\.kernels: liger (needs liger-kernel|runs Triton kernels on a CUDA)"
    ) as error:
        stages.load_model_stage(str(path))
    assert isinstance(error.value, InputError)  # the stage prints its message alone
    assert model_settings.current() == before
    with pytest.raises(Exception, match=r"^model\.kernels: liger"):  # the package missing here, else the CPU
        model_settings.configure(ModelSettings(kernels="liger"), device="cpu")
    assert model_settings.current() == before

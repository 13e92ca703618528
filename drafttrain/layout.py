"""Saved-drafter layout facts, the ground floor: file names, ``config.json`` keys, the ``drafter_type`` values
(and the older names read as today's), and the marks of the exported EAGLE-3 layouts. The drafters'
``save_pretrained``, the training methods, the exporters and the loaders (``drafttrain.artifacts``) all take them
from here; this module imports nothing of drafttrain.
"""
from __future__ import annotations

__all__ = [
    "CONFIG_NAME", "WEIGHTS_NAME", "TYPE_KEY", "TARGET_KEY", "EAGLE3_TYPE", "MEDUSA_TYPE", "MEDUSA2_TYPE",
    "DRAFT_MODEL_TYPE", "DFLASH_TYPE", "DRAFTER_TYPES", "DFLASH_ARCHITECTURE", "exported_dflash", "RENAMED_TYPES", "HEADS_KEY", "ADAPTER_KEY", "HEADS_DIR", "ADAPTER_DIR",
    "DRAFTER_SUBDIR", "TRTLLM_LAYOUT", "LAYOUT_KEY", "TRTLLM_OPTIONS_NAME", "TRTLLM_ARCHITECTURE",
    "TRTLLM_LAYER_PREFIX", "saved_type",
]

CONFIG_NAME = "config.json"  # every saved drafter directory: the drafter's config (drafter_type below)
WEIGHTS_NAME = "model.safetensors"  # eagle3 / medusa heads / exported EAGLE-3 tensors (HF names its own)
TYPE_KEY = "drafter_type"  # config.json key naming the drafter family (absent in an exported EAGLE-3 layout)
TARGET_KEY = "target_name_or_path"  # config.json key: the target the drafter was trained for
EAGLE3_TYPE = "eagle3"  # Eagle3Drafter: config.json (+ Eagle3DrafterConfig fields) + model.safetensors
MEDUSA_TYPE = "medusa"  # MedusaHeads: vLLM's Medusa layout (config.json + model.safetensors)
MEDUSA2_TYPE = "medusa2"  # config.json pointing at HEADS_DIR (a medusa directory) and ADAPTER_DIR (peft LoRA)
DRAFT_MODEL_TYPE = "draft_model"  # a plain HF causal LM directory (save_pretrained) + the target's tokenizer
DFLASH_TYPE = "dflash"  # DFlashDrafter: config.json (+ DFlashDrafterConfig fields) + model.safetensors (no embedding/head)
DRAFTER_TYPES = (EAGLE3_TYPE, MEDUSA_TYPE, MEDUSA2_TYPE, DRAFT_MODEL_TYPE, DFLASH_TYPE)
RENAMED_TYPES = {"draft_lm": DRAFT_MODEL_TYPE}  # drafter_type values older saves carry, read as today's
HEADS_KEY, ADAPTER_KEY = "heads", "adapter"  # medusa2 config.json keys naming its two subdirectories
HEADS_DIR, ADAPTER_DIR = "heads", "adapter"  # their names (also draft_model's adapter/ with distill.use_lora)
DRAFTER_SUBDIR = "drafter"  # <checkpoint>/drafter: a training checkpoint's drafter, built on first use
# the TensorRT-LLM (PyTorch backend) EAGLE-3 export (drafttrain.export.eagle3): a flat HF config + midlayer.* tensors
TRTLLM_LAYOUT = "trtllm"
LAYOUT_KEY = "drafttrain_layout"  # config.json key naming that layout (its architecture is SGLang's; TRT-LLM ignores it)
TRTLLM_OPTIONS_NAME = "extra_llm_api_options.yaml"  # beside config.json: trtllm-serve --extra_llm_api_options
TRTLLM_ARCHITECTURE = "LlamaForCausalLMEagle3"  # TRT-LLM strips "Eagle3", prefixes "EAGLE3": EAGLE3LlamaForCausalLM
TRTLLM_LAYER_PREFIX = "midlayer"  # its draft layers: midlayer.* (one layer), midlayer.{i}.* (several)
# the DFlash exports (drafttrain.export.dflash): z-lab's HF layout (vLLM, SGLang, TensorRT-LLM) and speculators'
DFLASH_ARCHITECTURE = "DFlashDraftModel"


def saved_type(cfg: dict) -> str | None:
    """The drafter family a saved ``config.json`` names (None for an exported EAGLE-3 layout); an older
    name (``RENAMED_TYPES``) is read as today's."""
    kind = cfg.get(TYPE_KEY)
    return RENAMED_TYPES.get(kind, kind)


def exported_dflash(config: dict) -> str | None:
    """``zlab`` / ``speculators`` for a DFlash export's config.json (drafttrain.export.dflash), else None."""
    if config.get("speculators_model_type") == "dflash":
        return "speculators"
    if DFLASH_ARCHITECTURE in (config.get("architectures") or []) and isinstance(config.get("dflash_config"), dict):
        return "zlab"
    return None

